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
    start(name, VLM, |o| {
        o.transfer = Some(pdserve_transport::TransferConfig::new(
            pdserve_transport::BackendKind::Local,
            name,
        ));
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
    let colocated = start("mm-ref", VLM, |_| {}).await;
    let mut want = Vec::new();
    for b in &bodies {
        want.push(token_ids(&ok(&colocated.url(), b).await));
    }
    colocated.stop().await;

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
            .contains("peer protocol carries token ids only"),
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
