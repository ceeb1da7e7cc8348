//! Image input over the OpenAI chat API on one colocated instance of the seeded synthetic
//! VLM (`synthetic:tiny,vision=1`, 16 rows per image): greedy output is deterministic and
//! depends on the image, images are chunked and prefix-cached by their digest, and every bad
//! input is a 400 naming the problem — with the block pool full afterwards.

mod common;
use common::{assert_pool_full, post_to};

use base64::Engine as _;
use pdserve_actors::{Instance, InstanceOptions};
use pdserve_gpu::loader::{load_model, ModelSource};
use serde_json::{json, Value};

const VLM: &str = "tiny,vision=1";

async fn start(name: &str, spec: &str, tweak: impl FnOnce(&mut InstanceOptions)) -> Instance {
    let model = load_model(&ModelSource::Synthetic(spec.into())).unwrap();
    let mut opts = InstanceOptions::local(name, model);
    opts.multimodal.max_images_per_request = 2;
    opts.multimodal.max_image_bytes = 64 << 10;
    opts.multimodal.max_image_width = 512;
    opts.multimodal.max_image_height = 512;
    tweak(&mut opts);
    Instance::start(opts).await.unwrap()
}

/// A PNG whose pixels depend on `seed`.
fn png(w: u32, h: u32, seed: u32) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| {
        let v = x.wrapping_mul(7 + seed) ^ y.wrapping_mul(13 + 3 * seed);
        image::Rgb([v as u8, (v >> 3) as u8 ^ seed as u8, (x + y + seed) as u8])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

/// Pixels that do not compress: a PNG of about `3·w·h` bytes.
fn noisy_png(w: u32, h: u32) -> Vec<u8> {
    let mut state = 0x9e37_79b9u32;
    let img = image::RgbImage::from_fn(w, h, |_, _| {
        let mut px = [0u8; 3];
        for p in &mut px {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            *p = state as u8;
        }
        image::Rgb(px)
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

fn jpeg(w: u32, h: u32, seed: u32) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| {
        image::Rgb([(x * 5 + seed) as u8, (y * 3) as u8, (x ^ y) as u8])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Jpeg).unwrap();
    out.into_inner()
}

fn data_url(media: &str, bytes: &[u8]) -> String {
    format!(
        "data:{media};base64,{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

fn image_part(url: &str) -> Value {
    json!({"type": "image_url", "image_url": {"url": url}})
}

/// A greedy chat request: text, then `images`, then more text.
fn chat(images: &[Value]) -> Value {
    let mut content =
        vec![json!({"type": "text", "text": "Describe this picture in detail, please: "})];
    content.extend(images.iter().cloned());
    content.push(json!({"type": "text", "text": " Thanks."}));
    json!({
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": true,
        "return_token_ids": true,
    })
}

fn token_ids(v: &Value) -> Vec<u64> {
    v["choices"][0]["token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("no token_ids: {v}"))
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

fn usage(v: &Value) -> (u64, u64) {
    (
        v["usage"]["prompt_tokens"].as_u64().unwrap(),
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
    )
}

async fn ok(url: &str, body: &Value) -> Value {
    let (status, v) = post_to(url, "/v1/chat/completions", body).await;
    assert_eq!(status, 200, "{v}");
    v
}

/// Greedy tokens of each of `bodies` on a colocated instance of the synthetic VLM (CPU), the
/// reference the disaggregated setups must give.
async fn reference_tokens(name: &str, bodies: &[Value]) -> Vec<Vec<u64>> {
    let inst = start(name, VLM, |_| {}).await;
    let mut want = Vec::new();
    for b in bodies {
        want.push(token_ids(&ok(&inst.url(), b).await));
    }
    inst.stop().await;
    want
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_output_with_an_image_is_deterministic_and_depends_on_the_image() {
    let inst = start("mm-greedy", VLM, |_| {}).await;
    let url = inst.url();
    let (a, b) = (
        image_part(&data_url("image/png", &png(40, 30, 1))),
        image_part(&data_url("image/png", &png(40, 30, 2))),
    );
    let first = ok(&url, &chat(std::slice::from_ref(&a))).await;
    let (prompt_a, cached_first) = usage(&first);
    assert_eq!(cached_first, 0);
    let text_only = ok(&url, &chat(&[])).await;
    // The image takes its 16 rows in the prompt.
    assert_eq!(prompt_a, usage(&text_only).0 + 16);

    // The same image again: the same tokens, its blocks from the prefix cache.
    let again = ok(&url, &chat(std::slice::from_ref(&a))).await;
    assert_eq!(token_ids(&again), token_ids(&first));
    let (_, cached_again) = usage(&again);
    assert_eq!(cached_again, (prompt_a - 1) / 16 * 16, "{again}");

    // Another image with the same text: other tokens, and only the text blocks before the
    // image shared (the placeholder tokens are the same: the digest keeps them apart).
    let other = ok(&url, &chat(std::slice::from_ref(&b))).await;
    assert_ne!(token_ids(&other), token_ids(&first));
    let (prompt_b, cached_b) = usage(&other);
    assert_eq!(prompt_b, prompt_a);
    assert!(cached_b < cached_again && cached_b % 16 == 0, "{other}");
    // ... and the text-only prompt is another answer again.
    assert_ne!(token_ids(&text_only), token_ids(&first));

    // A JPEG works too; `n` > 1 carries the image to every choice.
    let j = image_part(&data_url("image/jpeg", &jpeg(24, 24, 3)));
    let mut body = chat(&[j]);
    body["n"] = json!(2);
    let two = ok(&url, &body).await;
    let ids = common::choice_token_ids(&two);
    assert_eq!(ids[0], ids[1], "greedy choices of one prompt agree");
    assert_pool_full(&inst).await;
    inst.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_images_chunked_anywhere_give_the_same_tokens() {
    let images = [
        image_part(&data_url("image/png", &png(32, 32, 5))),
        image_part(&data_url("image/png", &png(50, 20, 6))),
    ];
    let body = chat(&images);
    let whole = start("mm-whole", VLM, |_| {}).await;
    let want = ok(&whole.url(), &body).await;
    // Swapping the images changes the answer.
    let swapped = ok(&whole.url(), &chat(&[images[1].clone(), images[0].clone()])).await;
    assert_ne!(token_ids(&swapped), token_ids(&want));
    assert_pool_full(&whole).await;
    whole.stop().await;
    // 7-token prefill chunks cut both images; no prefix cache, so every row is computed.
    let chunked = start("mm-chunked", VLM, |o| {
        o.max_num_seqs = 4;
        o.max_num_batched_tokens = 7;
        o.prefix_cache = false;
    })
    .await;
    let got = ok(&chunked.url(), &body).await;
    assert_eq!(token_ids(&got), token_ids(&want));
    assert_pool_full(&chunked).await;
    chunked.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_image_input_is_refused_with_a_400_naming_it() {
    let inst = start("mm-bad", VLM, |_| {}).await;
    let url = inst.url();
    let good = image_part(&data_url("image/png", &png(16, 16, 1)));
    let mut cut = png(64, 64, 2);
    cut.truncate(cut.len() / 2);
    let huge_bytes = noisy_png(200, 200);
    assert!(huge_bytes.len() > 64 << 10);
    let marker = json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "<|pdserve_image|>"}, good.clone()]}]});
    let assistant_image = json!({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [good.clone()]}]});
    let no_url = json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]});
    let audio = json!({"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]});
    let cases: Vec<(&str, Value, &[&str])> = vec![
        (
            "broken base64",
            chat(&[image_part("data:image/png;base64,!!!!not-base64")]),
            &["image 0", "base64"],
        ),
        (
            "too many bytes",
            chat(&[image_part(&data_url("image/png", &huge_bytes))]),
            &["image 0", "bytes", "65536"],
        ),
        (
            "too many pixels",
            chat(&[image_part(&data_url("image/png", &png(600, 8, 1)))]),
            &["600x8", "512x512"],
        ),
        (
            "too many images",
            chat(&[good.clone(), good.clone(), good.clone()]),
            &["3 images", "max_images_per_request"],
        ),
        (
            "unsupported media type",
            chat(&[image_part("data:image/gif;base64,R0lGODlhAQABAAAAACw=")]),
            &["unsupported image format", "image/gif"],
        ),
        (
            "a GIF sent as PNG",
            chat(&[image_part("data:image/png;base64,R0lGODlhAQABAAAAACw=")]),
            &["unsupported image format"],
        ),
        (
            "corrupt PNG",
            chat(&[good.clone(), image_part(&data_url("image/png", &cut))]),
            &["image 1", "does not decode"],
        ),
        (
            "remote URL",
            chat(&[image_part("https://example.com/cat.png")]),
            &["remote image URLs"],
        ),
        (
            "not a data URL",
            chat(&[image_part("file:///etc/passwd")]),
            &["data:"],
        ),
        (
            "not base64",
            chat(&[image_part("data:image/png,rawbytes")]),
            &["base64"],
        ),
        ("marker in the text", marker, &["<|pdserve_image|>"]),
        (
            "image from the assistant",
            assistant_image,
            &["user messages"],
        ),
        ("image part without url", no_url, &["image_url"]),
        ("audio part", audio, &["input_audio", "not supported"]),
    ];
    for (what, body, needles) in cases {
        let (status, v) = post_to(&url, "/v1/chat/completions", &body).await;
        assert_eq!(status, 400, "{what}: {v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        for n in needles {
            assert!(msg.contains(n), "{what}: `{msg}` lacks `{n}`");
        }
    }
    // The instance still serves images afterwards.
    ok(&url, &chat(std::slice::from_ref(&good))).await;
    assert_pool_full(&inst).await;
    inst.stop().await;

    // A text-only model refuses images by name.
    let text = start("mm-text", "tiny", |_| {}).await;
    let (status, v) = post_to(&text.url(), "/v1/chat/completions", &chat(&[good])).await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("does not take image input"),
        "{v}"
    );
    ok(&text.url(), &chat(&[])).await;
    assert_pool_full(&text).await;
    text.stop().await;
}

/// A prefill (`p-`) or decode (`d-`) instance of the synthetic VLM on the `local` transfer
/// backend, reached over the HTTP carrier of the peer protocol (no cluster credentials).
async fn pd_instance(name: &str) -> Instance {
    on_backend(name, BackendKind::Local, false).await
}

use pdserve_transport::BackendKind;

/// An instance of the synthetic VLM with a transfer engine on `backend` (an encode instance
/// with `encode`); a decode instance always drives its prefill remotely.
async fn on_backend(name: &str, backend: BackendKind, encode: bool) -> Instance {
    start(name, VLM, |o| {
        o.transfer = Some(pdserve_transport::TransferConfig::new(backend, name));
        o.encode = encode;
        o.min_remote_prompt_tokens = 0;
        o.multimodal.encoder_hold_slots = 4;
        o.kv_lease = std::time::Duration::from_secs(5);
    })
    .await
}

/// vLLM's two hops for a chat request: prefill with `max_tokens: 1` and `do_remote_decode`,
/// then decode with the `kv_transfer_params` the prefill answer names.
async fn via_two_hops(prefill: &str, decode: &str, original: &Value) -> Value {
    let mut p = original.clone();
    p["max_tokens"] = json!(1);
    p["stream"] = json!(false);
    p["kv_transfer_params"] = json!({"do_remote_decode": true});
    let answer = ok(prefill, &p).await;
    let params = answer["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true, "{answer}");
    let mut d = original.clone();
    d["kv_transfer_params"] = params;
    ok(decode, &d).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_decode_with_images_equals_colocated() {
    let bodies = [
        chat(&[image_part(&data_url("image/png", &png(40, 30, 1)))]),
        chat(&[
            image_part(&data_url("image/png", &png(32, 32, 5))),
            image_part(&data_url("image/jpeg", &jpeg(20, 28, 6))),
        ]),
        chat(&[image_part(&data_url("image/png", &png(40, 30, 2)))]),
    ];
    let want = reference_tokens("mm-ref", &bodies).await;

    let (p, d) = (pd_instance("p-mm").await, pd_instance("d-mm").await);
    for (i, b) in bodies.iter().enumerate() {
        let got = via_two_hops(&p.url(), &d.url(), b).await;
        assert_eq!(token_ids(&got), want[i], "request {i}: {got}");
    }
    // Again: the decode instance's prefix cache holds the first prompt's blocks (keyed by
    // the image's digest), so only the rest moves; the tokens are the same.
    let again = via_two_hops(&p.url(), &d.url(), &bodies[0]).await;
    assert_eq!(token_ids(&again), want[0]);

    // A decode instance that would drive the prefill itself refuses images by name.
    let mut drive = bodies[0].clone();
    let port = p.url().rsplit(':').next().unwrap().parse::<u16>().unwrap();
    drive["kv_transfer_params"] =
        json!({"do_remote_prefill": true, "remote_host": "127.0.0.1", "remote_port": port});
    let (status, v) = post_to(&d.url(), "/v1/chat/completions", &drive).await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("need an encode instance holding them"),
        "{v}"
    );
    assert_pool_full(&p).await;
    assert_pool_full(&d).await;
    p.stop().await;
    d.stop().await;
}

/// The KV tiers key an image's blocks by its digest as the prefix cache does: a prompt
/// evicted to the host tier comes back for the same image (its image blocks included) and
/// never for another image with the same placeholder tokens; every answer equals an
/// instance without tiers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_tiers_restore_image_blocks_by_the_images_digest() {
    let images: Vec<Value> = (11..14)
        .map(|seed| image_part(&data_url("image/png", &png(40, 30, seed))))
        .collect();
    let reference = start("mm-tiers-ref", VLM, |_| {}).await;
    let mut want = Vec::new();
    for img in &images {
        want.push(token_ids(
            &ok(&reference.url(), &chat(std::slice::from_ref(img))).await,
        ));
    }
    reference.stop().await;

    // A pool of 8 blocks of 16: one conversation at a time, each evicting the last.
    let tiers = pdserve_actors::kv_tiers::TierSettings::host_only(64 << 20);
    let inst = start("mm-tiers", VLM, |o| {
        o.num_blocks = Some(8);
        o.watermark = 0.0;
        o.kv_tiers = Some(tiers);
    })
    .await;
    let url = inst.url();
    for (img, want) in images.iter().zip(&want) {
        let v = ok(&url, &chat(std::slice::from_ref(img))).await;
        assert_eq!(&token_ids(&v), want, "{v}");
    }
    // The first image again: its whole prefix, image rows included, from the host tier.
    let v = ok(&url, &chat(std::slice::from_ref(&images[0]))).await;
    assert_eq!(token_ids(&v), want[0], "{v}");
    let (prompt, cached) = usage(&v);
    assert_eq!(cached, (prompt - 1) / 16 * 16, "{v}");
    assert_pool_full(&inst).await;
    inst.stop().await;
}

/// `POST /v1/encode` on an encode instance: the images' digests.
async fn encode_on(encoder: &str, body: &Value) -> Vec<String> {
    let (status, v) = post_to(encoder, "/v1/encode", body).await;
    assert_eq!(status, 200, "{v}");
    v["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["digest"].as_str().unwrap().to_string())
        .collect()
}

/// `body` as the proxy sends it on after the encode hop.
fn with_encoder(body: &Value, encoder: &str) -> Value {
    let mut b = body.clone();
    b["ec_transfer_params"] = json!({"encoder_url": encoder});
    b
}

/// `body` as the proxy sends it to a decode instance that drives `prefill` (one hop).
fn driving(body: &Value, prefill: &Instance) -> Value {
    let mut b = body.clone();
    let port = prefill
        .url()
        .rsplit(':')
        .next()
        .unwrap()
        .parse::<u16>()
        .unwrap();
    b["kv_transfer_params"] =
        json!({"do_remote_prefill": true, "remote_host": "127.0.0.1", "remote_port": port});
    b
}

async fn encoder_figures(encoder: &str) -> Value {
    common::get_json(encoder, "/v1/encoder").await
}

/// Images the encoder caches of `encoders` hold, together.
async fn cached_images(encoders: &[String]) -> u64 {
    let mut n = 0;
    for e in encoders {
        n += encoder_figures(e).await["cache"]["images"]
            .as_u64()
            .unwrap();
    }
    n
}

/// The correctness oracle for encoder disaggregation: on every transfer backend, greedy
/// tokens are the same colocated, E+PD (the colocated instance takes the embeddings from the
/// encode instance) and E+P+D (decode drives prefill, which takes them from the encoder by
/// reference), for one image and for two; each image is encoded once, later turns hit the
/// encoder cache, and every pool and hold slot is free afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encode_prefill_decode_equals_colocated_on_every_transport() {
    let bodies = [
        chat(&[image_part(&data_url("image/png", &png(40, 30, 21)))]),
        chat(&[
            image_part(&data_url("image/png", &png(32, 32, 22))),
            image_part(&data_url("image/jpeg", &jpeg(20, 28, 23))),
        ]),
    ];
    let want = reference_tokens("epd-ref", &bodies).await;

    for backend in [BackendKind::Local, BackendKind::Shm, BackendKind::Tcp] {
        let tag = backend.as_str();
        let e = on_backend(&format!("e-{tag}"), backend, true).await;
        let pd = on_backend(&format!("pd-{tag}"), backend, false).await;
        let p = on_backend(&format!("p-{tag}"), backend, false).await;
        let d = on_backend(&format!("d-{tag}"), backend, false).await;
        let mut holds = 0;
        for (i, b) in bodies.iter().enumerate() {
            let digests = encode_on(&e.url(), b).await;
            assert_eq!(digests.len(), i + 1);
            // E+PD.
            let got = ok(&pd.url(), &with_encoder(b, &e.url())).await;
            assert_eq!(token_ids(&got), want[i], "{tag} E+PD request {i}: {got}");
            // E+P+D: the decode instance takes the embeddings too (it may prefill a short
            // suffix itself), and the prefill instance takes them by reference.
            let got = ok(&d.url(), &driving(&with_encoder(b, &e.url()), &p)).await;
            assert_eq!(token_ids(&got), want[i], "{tag} E+P+D request {i}: {got}");
            holds += 3;
        }
        let f = encoder_figures(&e.url()).await;
        assert_eq!(f["hold_slots"]["served"], holds, "{tag}: {f}");
        assert_eq!(f["hold_slots"]["used"], 0, "{tag}: {f}");
        assert_eq!(f["cache"]["images"], 3, "{tag}: {f}");
        // A later turn with the same image: the encoder finds it in its cache, and the
        // instances in theirs (no new hold).
        encode_on(&e.url(), &bodies[0]).await;
        let got = ok(&pd.url(), &with_encoder(&bodies[0], &e.url())).await;
        assert_eq!(token_ids(&got), want[0], "{tag}: {got}");
        let f = encoder_figures(&e.url()).await;
        assert_eq!(f["cache"]["images"], 3, "{tag}: {f}");
        assert_eq!(f["hold_slots"]["served"], holds, "{tag}: {f}");
        for inst in [&e, &pd, &p, &d] {
            assert_pool_full(inst).await;
        }
        for inst in [e, pd, p, d] {
            inst.stop().await;
        }
    }
}

/// An encode instance that is gone by the time the prompt's instance asks for the
/// embeddings: a 502 naming the encoder (kind `encoder_failed`), on the colocated instance
/// and through decode → prefill; nothing is held afterwards and every instance serves the
/// next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_encoder_is_a_clear_error_and_nothing_leaks() {
    let body = chat(&[image_part(&data_url("image/png", &png(36, 24, 31)))]);
    let e = on_backend("e-dead", BackendKind::Tcp, true).await;
    let pd = on_backend("pd-dead", BackendKind::Tcp, false).await;
    let p = on_backend("p-dead", BackendKind::Tcp, false).await;
    let d = on_backend("d-dead", BackendKind::Tcp, false).await;
    let url = e.url();
    encode_on(&url, &body).await;
    e.stop().await;

    let (status, v) = post_to(
        &pd.url(),
        "/v1/chat/completions",
        &with_encoder(&body, &url),
    )
    .await;
    assert_eq!(status, 502, "{v}");
    assert_eq!(v["error"]["type"], "encoder_failed", "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains(&url) && msg.contains("unreachable"), "{v}");

    let (status, v) = post_to(
        &d.url(),
        "/v1/chat/completions",
        &driving(&with_encoder(&body, &url), &p),
    )
    .await;
    assert_eq!(status, 502, "{v}");
    // The decode instance cannot take the embeddings either: it fails before the hand-off.
    assert_eq!(v["error"]["type"], "encoder_failed", "{v}");

    // A malformed encoder URL is the client's error.
    let mut bad = body.clone();
    bad["ec_transfer_params"] = json!({"encoder_url": "ftp://x"});
    let (status, v) = post_to(&pd.url(), "/v1/chat/completions", &bad).await;
    assert_eq!(status, 400, "{v}");
    let mut bad = chat(&[]);
    bad["ec_transfer_params"] = json!({"encoder_url": url});
    let (status, v) = post_to(&pd.url(), "/v1/chat/completions", &bad).await;
    assert_eq!(status, 400, "{v}");

    // Every instance still serves, and holds nothing.
    let want = token_ids(&ok(&pd.url(), &body).await);
    assert_eq!(token_ids(&ok(&d.url(), &body).await), want);
    for inst in [&pd, &p, &d] {
        assert_pool_full(inst).await;
    }
    for inst in [pd, p, d] {
        inst.stop().await;
    }
}

/// The encoder protocol refuses what it cannot serve, by name: garbage frames, images it
/// does not hold, more images than its hold slots, a hold before a session on a keyed
/// backend; a hold nobody releases ends with its lease; and `/v1/encode` refuses bad images
/// with the colocated instance's 400s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_encoder_protocol_refuses_hostile_requests() {
    use pdserve_actors::encode::protocol::{
        decode_answer, encode_request, EcAnswer, EcRequest, EncoderError,
    };
    use pdserve_runtime::ids::TransferId;
    let e = start("e-hostile", VLM, |o| {
        o.transfer = Some(pdserve_transport::TransferConfig::new(
            BackendKind::Tcp,
            "e-hostile",
        ));
        o.encode = true;
        o.multimodal.encoder_hold_slots = 2;
        o.multimodal.max_images_per_request = 3;
        o.kv_lease = std::time::Duration::from_millis(300);
    })
    .await;
    let client = pdserve_actors::http::http_client().build().unwrap();
    let call = |body: Vec<u8>| {
        let (client, url) = (client.clone(), e.url());
        async move {
            let r = client
                .post(format!("{url}/v1/ec/peer"))
                .body(body)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            decode_answer(&r.bytes().await.unwrap()).unwrap()
        }
    };
    let failed = |a: EcAnswer| match a {
        EcAnswer::Failed(e) => e,
        other => panic!("expected a failure, got {other:?}"),
    };
    assert!(matches!(
        failed(call(vec![0xff; 40]).await),
        EncoderError::Protocol(_)
    ));
    let images: Vec<Value> = (0..3)
        .map(|i| image_part(&data_url("image/png", &png(16, 16, 40 + i))))
        .collect();
    let digests: Vec<[u8; 32]> = encode_on(&e.url(), &chat(&images))
        .await
        .iter()
        .map(|h| {
            let b: Vec<u8> = (0..32)
                .map(|i| u8::from_str_radix(&h[2 * i..2 * i + 2], 16).unwrap())
                .collect();
            b.try_into().unwrap()
        })
        .collect();
    let hold = |digests: Vec<[u8; 32]>| {
        encode_request(&EcRequest::Hold {
            hold: TransferId::new_random(),
            initiator: "reader".into(),
            digests,
        })
        .unwrap()
    };
    // No session yet on a keyed backend.
    let err = failed(call(hold(digests[..1].to_vec())).await);
    assert!(err.to_string().contains("no transfer session"), "{err}");
    let open = encode_request(&EcRequest::OpenSession {
        initiator: "reader".into(),
        fresh: true,
    })
    .unwrap();
    assert!(matches!(call(open).await, EcAnswer::Session(_)));
    // An image it never saw.
    let err = failed(call(hold(vec![[9; 32]])).await);
    assert!(matches!(err, EncoderError::NotCached(_)), "{err}");
    // More images than slots: refused whole, nothing taken.
    let err = failed(call(hold(digests.clone())).await);
    assert!(matches!(err, EncoderError::Overloaded(_)), "{err}");
    // Two held and never released: the lease frees the slots.
    assert!(matches!(
        call(hold(digests[..2].to_vec())).await,
        EcAnswer::Held(_)
    ));
    assert_eq!(encoder_figures(&e.url()).await["hold_slots"]["used"], 2);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while encoder_figures(&e.url()).await["hold_slots"]["used"] != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the lease never ended"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // Bad images at /v1/encode: the same 400s as a colocated instance.
    let (status, v) = post_to(
        &e.url(),
        "/v1/encode",
        &chat(&[image_part("data:image/png;base64,!!!")]),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    let (status, v) = post_to(&e.url(), "/v1/encode", &chat(&[])).await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no images"),
        "{v}"
    );
    // An encode instance generates nothing (its KV pool is one block).
    let (status, v) = post_to(&e.url(), "/v1/chat/completions", &chat(&images[..1])).await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("encode instance"),
        "{v}"
    );
    assert_eq!(e.stats().await.unwrap().blocks_total, 1);
    // A colocated instance is no encoder.
    let (status, v) = post_to(
        &on_backend("pd-hostile", BackendKind::Tcp, false)
            .await
            .url(),
        "/v1/encode",
        &chat(&images[..1]),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    assert_pool_full(&e).await;
    e.stop().await;
}

/// The proxy's three hops: a request with images goes to an encode instance first, then
/// decode drives prefill with the images by reference; the answer equals colocated, the same
/// image goes to the same encoder again (its cache hit), a bad image is the encoder's 400,
/// and a text request does not touch the encoders.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_routes_images_through_an_encoder() {
    let bodies = [
        chat(&[image_part(&data_url("image/png", &png(40, 30, 51)))]),
        chat(&[image_part(&data_url("image/jpeg", &jpeg(24, 24, 52)))]),
    ];
    let colocated = start("px-ref", VLM, |_| {}).await;
    let mut want = Vec::new();
    for b in &bodies {
        want.push(token_ids(&ok(&colocated.url(), b).await));
    }
    let text_want = token_ids(&ok(&colocated.url(), &chat(&[])).await);
    colocated.stop().await;

    let e0 = on_backend("px-e0", BackendKind::Tcp, true).await;
    let e1 = on_backend("px-e1", BackendKind::Tcp, true).await;
    let p = on_backend("px-p", BackendKind::Tcp, false).await;
    let d = on_backend("px-d", BackendKind::Tcp, false).await;
    let mut args = pdserve_actors::proxy::ProxyArgs::new(
        "127.0.0.1:0".parse().unwrap(),
        vec![p.url()],
        vec![d.url()],
    );
    args.encode = vec![e0.url(), e1.url()];
    let proxy = pdserve_actors::proxy::start_proxy("px-epd", args)
        .await
        .unwrap();
    let url = format!("http://{}", proxy.addr);
    // Static instances are routed to once the proxy polled them: wait for all four.
    common::wait_for_health(
        &url,
        std::time::Duration::from_secs(20),
        "the proxy never saw every instance",
        |h| h["encode"] == 2 && h["prefill"] == 1 && h["decode"] == 1,
    )
    .await;
    for (b, want) in bodies.iter().zip(&want) {
        let got = ok(&url, b).await;
        assert_eq!(&token_ids(&got), want, "{got}");
    }
    let held = |f: &Value| f["hold_slots"]["served"].as_u64().unwrap();
    let before = [
        held(&encoder_figures(&e0.url()).await),
        held(&encoder_figures(&e1.url()).await),
    ];
    assert!(before.iter().sum::<u64>() >= 2, "{before:?}");
    // The first image again goes to the encoder that holds it: its cache answers, no new
    // encoder learns it.
    let encoders = [e0.url(), e1.url()];
    let images_before = cached_images(&encoders).await;
    let got = ok(&url, &bodies[0]).await;
    assert_eq!(token_ids(&got), want[0]);
    let images_after = cached_images(&encoders).await;
    assert_eq!(images_after, images_before);
    // Text skips the encoders.
    assert_eq!(token_ids(&ok(&url, &chat(&[])).await), text_want);
    // A bad image is the encoder's 400, passed on.
    let (status, v) = post_to(
        &url,
        "/v1/chat/completions",
        &chat(&[image_part("data:image/gif;base64,R0lGODlhAQABAAAAACw=")]),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    for inst in [&e0, &e1, &p, &d] {
        assert_pool_full(inst).await;
    }
    // The encoder the first image goes to dies: the proxy encodes on the other one.
    let upstream = |u: String| pdserve_core::router::Upstream {
        url: u,
        host_port: None,
        role: pdserve_runtime::Role::Encode,
        load: None,
        control: None,
    };
    let image_url = bodies[0]["messages"][0]["content"][1]["image_url"]["url"]
        .as_str()
        .unwrap()
        .to_string();
    let first = pdserve_actors::proxy::encode::order(
        encoders.iter().cloned().map(upstream).collect(),
        &[image_url],
    )[0]
    .url
    .clone();
    let (dead, alive) = if first == e0.url() {
        (e0, e1)
    } else {
        (e1, e0)
    };
    dead.stop().await;
    let got = ok(&url, &bodies[0]).await;
    assert_eq!(token_ids(&got), want[0], "{got}");
    let metrics = common::get_text(&url, "/metrics").await;
    assert!(
        metrics.contains("pdserve_proxy_encode_total{outcome=\"failed\"}"),
        "{metrics}"
    );
    proxy.stop().await;
    for inst in [alive, p, d] {
        inst.stop().await;
    }
}

/// The VisionEncoder is a supervised actor with an executor thread of its own: one that
/// panics fails the request it held (a 500), is restarted in place, and the next requests are
/// encoded — the encoder cache survives the restart, and the pool is full afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_vision_encoder_is_restarted_and_keeps_its_cache() {
    let inst = start("mm-encoder-restart", VLM, |_| {}).await;
    let a = chat(&[image_part(&data_url("image/png", &png(40, 30, 61)))]);
    let b = chat(&[image_part(&data_url("image/png", &png(40, 30, 62)))]);
    let want = token_ids(&ok(&inst.url(), &a).await);
    let encoder = |snap: &pdserve_runtime::supervision::ActorSnapshot| {
        snap.children
            .iter()
            .find(|c| c.kind == "VisionEncoder")
            .cloned()
            .expect("a VLM instance has a VisionEncoder")
    };
    assert_eq!(encoder(&inst.snapshot().await.unwrap()).restarts, 0);
    inst.inject_panic("VisionEncoder", 0).await.unwrap();
    let (status, v) = post_to(&inst.url(), "/v1/chat/completions", &b).await;
    assert_eq!(status, 500, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("image encoder"),
        "{v}"
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let e = encoder(&inst.snapshot().await.unwrap());
        if e.restarts == 1 && e.state == pdserve_runtime::supervision::ActorState::Running {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "not restarted: {e:?}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // The first image from the cache the restart kept; the second encoded by the new thread.
    assert_eq!(token_ids(&ok(&inst.url(), &a).await), want);
    ok(&inst.url(), &b).await;
    assert_pool_full(&inst).await;
    inst.stop().await;
}

/// Between instances with cluster credentials the encoder protocol rides the mutual-TLS
/// control plane (its session keys never travel over HTTP): the embeddings are taken from
/// the encode instance all the same, over `tcp` and over `quic` (whose connections are
/// mutual TLS from the same cluster CA), and the encoder refuses `POST /v1/ec/peer`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_cluster_credentials_the_encoder_protocol_rides_the_control_plane() {
    for backend in [BackendKind::Tcp, BackendKind::Quic] {
        encoder_on_the_control_plane(backend).await;
    }
}

async fn encoder_on_the_control_plane(backend: BackendKind) {
    use pdserve_actors::control_plane::InstanceControl;
    use pdserve_runtime::Role;
    use pdserve_transport::control::tls::ClusterCredentials;
    let tag = backend.as_str();
    let cluster = ClusterCredentials::ephemeral("mm-cp").unwrap();
    let body = chat(&[image_part(&data_url("image/png", &png(40, 30, 71)))]);
    let reference = start(&format!("mm-cp-ref-{tag}"), VLM, |_| {}).await;
    let want = token_ids(&ok(&reference.url(), &body).await);
    reference.stop().await;
    let member = |name: &str, role: Role, encode: bool| {
        let creds = cluster.issue(name).unwrap();
        let name = name.to_string();
        move |o: &mut InstanceOptions| {
            let mut t = pdserve_transport::TransferConfig::new(backend, &name);
            if backend == BackendKind::Quic {
                t.credentials = Some(creds.clone());
            }
            o.transfer = Some(t);
            o.encode = encode;
            o.control = Some(InstanceControl::new(creds, role));
        }
    };
    let (e_name, pd_name) = (format!("mm-cp-e-{tag}"), format!("mm-cp-pd-{tag}"));
    let e = start(&e_name, VLM, member(&e_name, Role::Encode, true)).await;
    let pd = start(&pd_name, VLM, member(&pd_name, Role::Colocated, false)).await;
    encode_on(&e.url(), &body).await;
    let got = ok(&pd.url(), &with_encoder(&body, &e.url())).await;
    assert_eq!(token_ids(&got), want, "{tag}: {got}");
    assert_eq!(encoder_figures(&e.url()).await["hold_slots"]["served"], 1);
    // The HTTP carrier is refused: this encoder speaks the protocol on its control plane.
    let r = pdserve_actors::http::http_client()
        .build()
        .unwrap()
        .post(format!("{}/v1/ec/peer", e.url()))
        .body(
            pdserve_actors::encode::protocol::encode_request(
                &pdserve_actors::encode::protocol::EcRequest::Info,
            )
            .unwrap(),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    assert_pool_full(&pd).await;
    pd.stop().await;
    e.stop().await;
}

/// A proxy with no encode instance sends a request with images to decode, which encodes and
/// prefills it itself (a prefill instance takes images only by reference from an encoder);
/// the answer equals colocated and the prefill instance computes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_encoder_the_proxy_prefills_images_on_decode() {
    let body = chat(&[image_part(&data_url("image/png", &png(40, 30, 81)))]);
    let reference = start("px-noenc-ref", VLM, |_| {}).await;
    let want = token_ids(&ok(&reference.url(), &body).await);
    reference.stop().await;
    let p = on_backend("px-noenc-p", BackendKind::Tcp, false).await;
    let d = on_backend("px-noenc-d", BackendKind::Tcp, false).await;
    let args = pdserve_actors::proxy::ProxyArgs::new(
        "127.0.0.1:0".parse().unwrap(),
        vec![p.url()],
        vec![d.url()],
    );
    let proxy = pdserve_actors::proxy::start_proxy("px-noenc", args)
        .await
        .unwrap();
    let url = format!("http://{}", proxy.addr);
    common::wait_for_health(
        &url,
        std::time::Duration::from_secs(20),
        "the proxy never became ready",
        |h| h["ready"] == true,
    )
    .await;
    let got = ok(&url, &body).await;
    assert_eq!(token_ids(&got), want, "{got}");
    assert_eq!(
        p.stats().await.unwrap().prompt_tokens,
        0,
        "prefill computed nothing"
    );
    assert_pool_full(&p).await;
    assert_pool_full(&d).await;
    proxy.stop().await;
    p.stop().await;
    d.stop().await;
}

/// Image rows on ranks that keep their KV on a device (the CUDA executor's contract, run by
/// its CPU stand-in: a private cache, a host mirror by role). A colocated instance there
/// keeps its transfer engine for image rows alone (no KV mirror) and refuses to hold KV for
/// a peer; colocated, E+PD and E+P+D (prefill writing through its mirror, decode uploading
/// what landed) give the CPU's greedy tokens, and every pool ends full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_on_a_device_kv_cache_give_the_cpu_tokens() {
    use pdserve_actors::worker::{KvMirror, RankDevice, StandInFaults};
    let bodies = [
        chat(&[image_part(&data_url("image/png", &png(40, 30, 1)))]),
        chat(&[
            image_part(&data_url("image/png", &png(32, 32, 62))),
            image_part(&data_url("image/png", &png(24, 20, 63))),
        ]),
        // A fresh image read into the scratch region the first request's read left for reuse
        // (stale bytes there would give the first image's tokens).
        chat(&[image_part(&data_url("image/png", &png(40, 30, 2)))]),
    ];
    let want = reference_tokens("dev-ref", &bodies).await;
    assert_ne!(
        want[0], want[2],
        "the two one-image requests must differ to tell reuse apart"
    );

    let on_device = |name: &'static str, mirror: KvMirror, encode: bool| async move {
        start(name, VLM, |o| {
            o.transfer = Some(pdserve_transport::TransferConfig::new(
                BackendKind::Tcp,
                name,
            ));
            o.device = RankDevice::StandIn {
                mirror,
                faults: StandInFaults::new(),
            };
            o.encode = encode;
            o.min_remote_prompt_tokens = 0;
            o.multimodal.encoder_hold_slots = 4;
        })
        .await
    };
    let e = on_backend("dev-e", BackendKind::Tcp, true).await;
    let c = on_device("dev-c", KvMirror::Off, false).await;
    let p = on_device("dev-p", KvMirror::WriteThrough, false).await;
    let d = on_device("dev-d", KvMirror::Receive, false).await;
    for (i, b) in bodies.iter().enumerate() {
        let got = ok(&c.url(), b).await;
        assert_eq!(token_ids(&got), want[i], "colocated request {i}: {got}");
        encode_on(&e.url(), b).await;
        let got = ok(&c.url(), &with_encoder(b, &e.url())).await;
        assert_eq!(token_ids(&got), want[i], "E+PD request {i}: {got}");
        let got = ok(&d.url(), &driving(&with_encoder(b, &e.url()), &p)).await;
        assert_eq!(token_ids(&got), want[i], "E+P+D request {i}: {got}");
    }
    // No mirror: the colocated instance has no KV a peer could read.
    let mut held = bodies[0].clone();
    held["max_tokens"] = json!(1);
    held["kv_transfer_params"] = json!({"do_remote_decode": true});
    let (status, v) = post_to(&c.url(), "/v1/chat/completions", &held).await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v.to_string()
            .contains("without a host mirror peers can read"),
        "{v}"
    );
    for inst in [&e, &c, &p, &d] {
        assert_pool_full(inst).await;
    }
    for inst in [e, c, p, d] {
        inst.stop().await;
    }
}

/// The synthetic VLM with SmolVLM's image splitting: tiles of 32 of an image resized to a
/// longest edge of 64, so a 64x48 image is 2x2 tiles plus the global image.
const SPLIT_VLM: &str = "tiny,vision=1,split=1";

async fn split_instance(name: &str, transfer: Option<(BackendKind, bool)>) -> Instance {
    start(name, SPLIT_VLM, |o| {
        o.multimodal.max_images_per_request = 16;
        if let Some((backend, encode)) = transfer {
            o.transfer = Some(pdserve_transport::TransferConfig::new(backend, name));
            o.encode = encode;
            o.min_remote_prompt_tokens = 0;
            o.multimodal.encoder_hold_slots = 16;
            o.kv_lease = std::time::Duration::from_secs(5);
        }
    })
    .await
}

/// Image splitting end to end: each image's tiles and global image are sub-images of their
/// own, wrapped in the prompt as SmolVLM's processor writes it; greedy tokens are
/// deterministic and the same colocated and E+PD (the sub-images move by their digests
/// through one encoder hold); a request of more sub-images than one request may have is a
/// 400 naming them on every instance; pools and hold slots are free afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_images_give_the_same_tokens_colocated_and_through_an_encoder() {
    let bodies = [
        chat(&[image_part(&data_url("image/png", &png(64, 48, 41)))]),
        chat(&[
            image_part(&data_url("image/png", &png(20, 60, 42))),
            image_part(&data_url("image/jpeg", &jpeg(40, 30, 43))),
        ]),
    ];
    let too_many = chat(&vec![
        image_part(&data_url("image/png", &png(64, 48, 44)));
        13
    ]);
    let refused = |status: u16, v: &Value| {
        assert_eq!(status, 400, "{v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains("65 sub-images") && msg.contains("64"), "{v}");
    };

    let colocated = split_instance("split-ref", None).await;
    let url = colocated.url();
    let mut want = Vec::new();
    for b in &bodies {
        let first = ok(&url, b).await;
        let again = ok(&url, b).await;
        assert_eq!(token_ids(&first), token_ids(&again), "{again}");
        want.push(token_ids(&first));
    }
    // 2x2 tiles and the global image of 16 rows each, 4 tile tokens and their 4 wrappers,
    // `<fake><global-img>` … `<fake>`, "\n" after the first row of tiles and "\n\n" after
    // the last (one byte a token here).
    let text_only = usage(&ok(&url, &chat(&[])).await).0;
    let one = usage(&ok(&url, &bodies[0]).await).0;
    assert_eq!(one - text_only, 5 * 16 + 8 + 3 + 1 + 2);
    let (status, v) = post_to(&url, "/v1/chat/completions", &too_many).await;
    refused(status, &v);
    assert_pool_full(&colocated).await;
    colocated.stop().await;

    let backend = BackendKind::Local;
    let e = split_instance("e-split", Some((backend, true))).await;
    let pd = split_instance("pd-split", Some((backend, false))).await;
    for (i, b) in bodies.iter().enumerate() {
        let (status, v) = post_to(&e.url(), "/v1/encode", b).await;
        assert_eq!(status, 200, "{v}");
        let images = v["images"].as_array().unwrap();
        assert_eq!(images.len(), i + 1, "{v}");
        assert_eq!(
            images[0]["sub_images"].as_array().unwrap().len(),
            [5, 3][i],
            "{v}"
        );
        let got = ok(&pd.url(), &with_encoder(b, &e.url())).await;
        assert_eq!(token_ids(&got), want[i], "E+PD request {i}: {got}");
    }
    let f = encoder_figures(&e.url()).await;
    // Sub-images: 5, then 3 and 5.
    assert_eq!(f["cache"]["images"], 13, "{f}");
    assert_eq!(f["hold_slots"]["served"], 2, "{f}");
    assert_eq!(f["hold_slots"]["used"], 0, "{f}");
    let (status, v) = post_to(&e.url(), "/v1/encode", &too_many).await;
    refused(status, &v);
    let (status, v) = post_to(
        &pd.url(),
        "/v1/chat/completions",
        &with_encoder(&too_many, &e.url()),
    )
    .await;
    refused(status, &v);
    for inst in [&e, &pd] {
        assert_pool_full(inst).await;
    }
    e.stop().await;
    pd.stop().await;
}
