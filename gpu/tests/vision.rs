//! The vision-language path of the forward pass on the seeded synthetic VLM
//! (`synthetic:...,vision=1`): image preprocessing and the SigLIP/Idefics3 tower, and image
//! rows spliced into a prompt's embeddings at its placeholder tokens — chunked anywhere,
//! at any TP size.

use pdserve_gpu::engine::{Engine, EngineOptions};
use pdserve_gpu::loader::{load_model, LoadedModel, ModelSource};
use pdserve_gpu::model::{Batch, EmbedSpan, SeqChunk};
use pdserve_gpu::vision::{prepare_image, ImageEmbeds, ImageLimits, VisionConfig, VisionTower};
use pdserve_gpu::ModelError;
use std::sync::Arc;

const SPEC: &str = "small,vision=1";

fn synthetic_vlm() -> LoadedModel {
    load_model(&ModelSource::Synthetic(SPEC.into())).unwrap()
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

fn encode(tower: &VisionTower, bytes: &[u8]) -> Arc<ImageEmbeds> {
    let img = prepare_image(bytes, tower.config(), &ImageLimits::default()).unwrap();
    Arc::new(tower.encode(&img).unwrap())
}

fn engine(model: LoadedModel, tp: usize) -> Engine {
    Engine::new(
        model,
        EngineOptions {
            tp,
            num_blocks: Some(64),
            ..Default::default()
        },
    )
    .unwrap()
}

/// 5 text tokens, the image's placeholders, 9 text tokens.
fn prompt(image_token: u32, rows: usize) -> (Vec<u32>, usize) {
    let mut p: Vec<u32> = (0..5).map(|i| 40 + i).collect();
    let at = p.len();
    p.extend(std::iter::repeat_n(image_token, rows));
    p.extend((0..9).map(|i| 97 + i));
    (p, at)
}

/// Runs `p` as chunks split at `cuts`, the image at `at`; logits of the last token.
fn logits_chunked(
    e: &Engine,
    p: &[u32],
    at: usize,
    img: &Arc<ImageEmbeds>,
    cuts: &[usize],
) -> Vec<f32> {
    let table: Vec<u32> = (0..p.len().div_ceil(16) as u32).collect();
    let mut bounds = vec![0];
    bounds.extend_from_slice(cuts);
    bounds.push(p.len());
    let mut last = Vec::new();
    for w in bounds.windows(2) {
        let (start, end) = (w[0], w[1]);
        // The part of the image inside this chunk.
        let (lo, hi) = (at.max(start), (at + img.rows).min(end));
        let embeds = if lo < hi {
            vec![EmbedSpan {
                at: lo - start,
                image: img.clone(),
                from: lo - at,
                len: hi - lo,
            }]
        } else {
            Vec::new()
        };
        let batch = Batch {
            seqs: vec![SeqChunk {
                tokens: p[start..end].to_vec(),
                start_pos: start,
                block_table: table.clone(),
                want_logits: end == p.len(),
                all_logits: false,
                embeds,
            }],
        };
        last = e.group().step(batch).unwrap();
    }
    last.remove(0)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map(|(i, _)| i)
        .unwrap()
}

#[test]
fn the_tower_encodes_an_image_into_decoder_rows() {
    let m = synthetic_vlm();
    let tower = m.vision.clone().expect("vision=1 has a tower");
    let cfg = tower.config();
    assert_eq!(cfg.tokens_per_image(), 16);
    assert_eq!(cfg.text_hidden_size, m.config.hidden_size);
    let a = encode(&tower, &png(48, 40, 1));
    assert_eq!((a.rows, a.width), (16, m.config.hidden_size));
    assert!(a.data.iter().all(|v| v.is_finite()));
    // Same bytes, same rows; another image, other rows.
    let again = encode(&tower, &png(48, 40, 1));
    assert_eq!(a.data, again.data);
    assert_eq!(a.digest, again.digest);
    let b = encode(&tower, &png(48, 40, 2));
    assert_ne!(a.digest, b.digest);
    assert!(max_diff(&a.data, &b.data) > 1e-2);
    // A text-only spec has no tower.
    let text = load_model(&ModelSource::Synthetic("small".into())).unwrap();
    assert!(text.vision.is_none());
}

#[test]
fn image_rows_replace_placeholder_embeddings_chunked_anywhere() {
    let m = synthetic_vlm();
    let tower = m.vision.clone().unwrap();
    let image_token = tower.config().image_token_id;
    let (a, b) = (
        encode(&tower, &png(32, 32, 3)),
        encode(&tower, &png(32, 32, 4)),
    );
    let (p, at) = prompt(image_token, a.rows);
    let e = engine(m, 1);
    let whole = logits_chunked(&e, &p, at, &a, &[]);
    // Chunks that cut the image (rows 0..3 | 3..16) and that cut before and after it give
    // the same logits: each row sits at its own position, whatever chunk carries it.
    for cuts in [&[8usize][..], &[3, 12, 25], &[5, 21]] {
        let chunked = logits_chunked(&e, &p, at, &a, cuts);
        assert!(max_diff(&whole, &chunked) < 1e-3, "cuts {cuts:?}");
    }
    // The image matters: another image, or none (the bare placeholder embedding), differs.
    let other = logits_chunked(&e, &p, at, &b, &[]);
    assert!(max_diff(&whole, &other) > 1e-2);
    let empty = Arc::new(ImageEmbeds {
        digest: a.digest,
        rows: 0,
        width: a.width,
        data: Vec::new(),
    });
    let bare = logits_chunked(&e, &p, at, &empty, &[]);
    assert!(max_diff(&whole, &bare) > 1e-2);

    // Tensor parallelism splits the decoder, not the image rows: tp=2 gives the same.
    let e2 = engine(synthetic_vlm(), 2);
    let tp2 = logits_chunked(&e2, &p, at, &a, &[9]);
    assert!(max_diff(&whole, &tp2) < 1e-3);
    assert_eq!(argmax(&whole), argmax(&tp2));
}

#[test]
fn embeddings_that_do_not_fit_are_refused_before_any_work() {
    let m = synthetic_vlm();
    let tower = m.vision.clone().unwrap();
    let img = encode(&tower, &png(16, 16, 5));
    let e = engine(m, 1);
    let chunk = |at: usize, from: usize, len: usize| SeqChunk {
        tokens: vec![259; 16],
        start_pos: 0,
        block_table: vec![0],
        want_logits: true,
        all_logits: false,
        embeds: vec![EmbedSpan {
            at,
            image: img.clone(),
            from,
            len,
        }],
    };
    for (at, from, len) in [
        (1, 0, 16),
        (0, 1, 16),
        (usize::MAX, 0, 2),
        (0, usize::MAX, 2),
    ] {
        let err = e
            .group()
            .step(Batch {
                seqs: vec![chunk(at, from, len)],
            })
            .unwrap_err();
        assert!(matches!(err, ModelError::InvalidBatch(_)), "{err}");
    }
    assert!(e
        .group()
        .step(Batch {
            seqs: vec![chunk(0, 0, 16)]
        })
        .is_ok());
}

/// Encoder time per image, printed (not asserted): the synthetic tower, and a tower of
/// SmolVLM-256M's shape (SigLIP-B/16 at 512×512: 1024 patches, 768 wide, 12 layers, 12 heads,
/// MLP 3072, pixel shuffle 4 → 64 rows of 576) with random weights. Run with
/// `cargo test --release -p pdserve-gpu --test vision -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement, not a check"]
fn measure_encoder_time() {
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    use std::collections::HashMap;
    let time = |tower: &VisionTower, bytes: &[u8]| {
        let lim = ImageLimits::default();
        let t0 = std::time::Instant::now();
        let img = prepare_image(bytes, tower.config(), &lim).unwrap();
        let t1 = std::time::Instant::now();
        let e = tower.encode(&img).unwrap();
        let t2 = std::time::Instant::now();
        (t1 - t0, t2 - t1, e.rows)
    };
    let img = png(640, 480, 7);
    let synthetic = synthetic_vlm().vision.unwrap();
    for _ in 0..3 {
        let (prep, enc, rows) = time(&synthetic, &img);
        println!("synthetic tower: 640x480 PNG prepare {prep:?}, encode {enc:?}, {rows} rows");
    }
    let cfg = VisionConfig {
        image_size: 512,
        patch_size: 16,
        hidden_size: 768,
        num_layers: 12,
        num_heads: 12,
        intermediate_size: 3072,
        layer_norm_eps: 1e-6,
        scale_factor: 4,
        text_hidden_size: 576,
        image_mean: [0.5; 3],
        image_std: [0.5; 3],
        image_token_id: 49190,
        splitting: None,
        wrap: None,
    };
    let mut t: HashMap<String, std::sync::Arc<QTensor>> = HashMap::new();
    let mut put = |name: String, shape: &[usize]| {
        let x = Tensor::randn(0f32, 0.02, shape, &Device::Cpu).unwrap();
        t.insert(
            name,
            std::sync::Arc::new(QTensor::quantize(&x, GgmlDType::F32).unwrap()),
        );
    };
    let (h, f) = (768, 3072);
    put("v.patch_embd.weight".into(), &[h, 3, 16, 16]);
    put("v.patch_embd.bias".into(), &[h]);
    put("v.position_embd.weight".into(), &[1024, h]);
    for i in 0..12 {
        for n in ["ln1", "ln2"] {
            put(format!("v.blk.{i}.{n}.weight"), &[h]);
            put(format!("v.blk.{i}.{n}.bias"), &[h]);
        }
        for (n, o, inp) in [
            ("attn_q", h, h),
            ("attn_k", h, h),
            ("attn_v", h, h),
            ("attn_out", h, h),
            ("ffn_up", f, h),
            ("ffn_down", h, f),
        ] {
            put(format!("v.blk.{i}.{n}.weight"), &[o, inp]);
            put(format!("v.blk.{i}.{n}.bias"), &[o]);
        }
    }
    put("v.post_ln.weight".into(), &[h]);
    put("v.post_ln.bias".into(), &[h]);
    put("mm.model.fc.weight".into(), &[576, h * 16]);
    let store = pdserve_gpu::weights::TensorStore::from_map(t, "smolvlm-shaped");
    let tower = VisionTower::from_store(&cfg, &store).unwrap();
    for _ in 0..3 {
        let (prep, enc, rows) = time(&tower, &img);
        println!(
            "SmolVLM-256M-shaped tower: 640x480 PNG prepare {prep:?}, encode {enc:?}, {rows} rows"
        );
    }
}

/// A decoder GGUF plus an `mmproj` GGUF beside it (llama.cpp's layout for a vision-language
/// model) load as the same VLM as the in-memory synthetic one: the tower read from the file
/// gives the same rows, bit for bit; files that do not fit are refused by name.
#[test]
fn an_mmproj_file_beside_the_decoder_loads_the_same_tower() {
    use pdserve_gpu::loader::attach_mmproj;
    use pdserve_gpu::mmproj::load_mmproj;
    use pdserve_gpu::synthetic::{write_gguf, write_mmproj, SyntheticSpec};
    let dir = tempfile::tempdir().unwrap();
    let spec = SyntheticSpec::parse(SPEC).unwrap();
    let (decoder, mmproj) = (dir.path().join("vlm.gguf"), dir.path().join("mmproj.gguf"));
    write_gguf(&spec, &decoder, candle_core::quantized::GgmlDType::F32).unwrap();
    write_mmproj(&spec, &mmproj).unwrap();

    let mut m = load_model(&ModelSource::Path(decoder.clone())).unwrap();
    assert!(m.vision.is_none(), "a decoder GGUF alone is a text model");
    attach_mmproj(&mut m, &mmproj).unwrap();
    let loaded = m.vision.clone().unwrap();
    let reference = synthetic_vlm().vision.unwrap();
    assert_eq!(loaded.config(), reference.config());
    for seed in [3, 4] {
        let bytes = png(50, 38, seed);
        let (a, b) = (encode(&loaded, &bytes), encode(&reference, &bytes));
        assert_eq!(a.digest, b.digest);
        assert_eq!(a.data, b.data, "image {seed}");
    }
    // Twice is refused; a decoder of another width does not fit the projector.
    let err = attach_mmproj(&mut m, &mmproj).unwrap_err().to_string();
    assert!(err.contains("has a vision tower already"), "{err}");
    let other = load_model(&ModelSource::Synthetic("small,hidden=128".into())).unwrap();
    let err = load_mmproj(&mmproj, &other.config, &other.tokenizer)
        .unwrap_err()
        .to_string();
    assert!(err.contains("mm.model.fc.weight"), "{err}");
    // The decoder's GGUF is not an mmproj file.
    let err = load_mmproj(&decoder, &m.config, &m.tokenizer)
        .unwrap_err()
        .to_string();
    assert!(err.contains("clip.projector_type"), "{err}");
}

/// An HF Idefics3 / SmolVLM checkpoint directory (`config.json` with `text_config` and
/// `vision_config`, `preprocessor_config.json`, `model.safetensors` under the HF names) written
/// from the synthetic VLM loads as the same VLM: the tower gives the same rows bit for bit, and
/// the decoder the same logits for a prompt holding an image.
#[test]
fn an_hf_smolvlm_directory_loads_the_same_vlm() {
    use pdserve_gpu::synthetic::{write_safetensors_dir, SyntheticSpec};
    let dir = tempfile::tempdir().unwrap();
    let spec = SyntheticSpec::parse(SPEC).unwrap();
    write_safetensors_dir(&spec, dir.path(), false).unwrap();
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "idefics3");
    assert!(dir.path().join("preprocessor_config.json").exists());

    let loaded = load_model(&ModelSource::Path(dir.path().to_path_buf())).unwrap();
    let reference = synthetic_vlm();
    assert_eq!(loaded.config, reference.config);
    let (tower, ref_tower) = (
        loaded
            .vision
            .clone()
            .expect("an Idefics3 directory has a tower"),
        reference.vision.clone().unwrap(),
    );
    assert_eq!(tower.config(), ref_tower.config());
    assert!(
        !loaded.store.names().any(|n| n.starts_with("v.")),
        "the tower's tensors leave the decoder's store"
    );
    let mut images = Vec::new();
    for seed in [3, 4] {
        let bytes = png(50, 38, seed);
        let (a, b) = (encode(&tower, &bytes), encode(&ref_tower, &bytes));
        assert_eq!(a.digest, b.digest);
        assert_eq!(a.data, b.data, "image {seed}");
        images.push(a);
    }
    let (p, at) = prompt(tower.config().image_token_id, images[0].rows);
    let ours = logits_chunked(&engine(loaded, 1), &p, at, &images[0], &[7]);
    let theirs = logits_chunked(&engine(reference, 1), &p, at, &images[0], &[7]);
    assert_eq!(argmax(&ours), argmax(&theirs));
    assert!(max_diff(&ours, &theirs) < 1e-5);
}

/// Writes the synthetic VLM's HF directory, then lets `edit` change its `config.json`,
/// `preprocessor_config.json` and tensors.
fn edited_hf_vlm(
    edit: impl FnOnce(
        &mut serde_json::Value,
        &mut serde_json::Value,
        &mut std::collections::HashMap<String, candle_core::Tensor>,
    ),
) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let spec = pdserve_gpu::synthetic::SyntheticSpec::parse(SPEC).unwrap();
    pdserve_gpu::synthetic::write_safetensors_dir(&spec, dir.path(), false).unwrap();
    let read = |name: &str| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(dir.path().join(name)).unwrap()).unwrap()
    };
    let (mut config, mut pre) = (read("config.json"), read("preprocessor_config.json"));
    let st = dir.path().join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&st, &candle_core::Device::Cpu).unwrap();
    edit(&mut config, &mut pre, &mut tensors);
    let write = |name: &str, v: &serde_json::Value| {
        std::fs::write(dir.path().join(name), serde_json::to_vec(v).unwrap()).unwrap();
    };
    write("config.json", &config);
    write("preprocessor_config.json", &pre);
    candle_core::safetensors::save(&tensors, &st).unwrap();
    dir
}

/// Configs that do not fit the checkpoint, or that are hostile, are refused by name, before
/// anything is sized by their counts.
#[test]
fn hf_vlm_directories_that_do_not_fit_are_refused_by_name() {
    type Edit = Box<
        dyn FnOnce(
            &mut serde_json::Value,
            &mut serde_json::Value,
            &mut std::collections::HashMap<String, candle_core::Tensor>,
        ),
    >;
    let cases: Vec<(&str, Edit)> = vec![
        (
            // A vision width the tensors do not have.
            "model.vision_model.embeddings.patch_embedding.weight",
            Box::new(|c, _, _| c["vision_config"]["hidden_size"] = 32.into()),
        ),
        (
            "model.vision_model.encoder.layers.1.mlp.fc2.bias",
            Box::new(|_, _, t| {
                t.remove("model.vision_model.encoder.layers.1.mlp.fc2.bias");
            }),
        ),
        (
            "model.connector.modality_projection.proj.weight",
            Box::new(|_, _, t| {
                t.remove("model.connector.modality_projection.proj.weight");
            }),
        ),
        (
            "vision_config.num_hidden_layers",
            Box::new(|c, _, _| c["vision_config"]["num_hidden_layers"] = 1e12.into()),
        ),
        (
            // More layers than the checkpoint has: the first missing one is named.
            "model.vision_model.encoder.layers.2.layer_norm1.weight",
            Box::new(|c, _, _| c["vision_config"]["num_hidden_layers"] = 100_000.into()),
        ),
        (
            // Fewer: the checkpoint's extra layer is not silently dropped.
            "encoder layer 1",
            Box::new(|c, _, _| c["vision_config"]["num_hidden_layers"] = 1.into()),
        ),
        (
            "text_config: `num_hidden_layers`",
            Box::new(|c, _, _| c["text_config"]["num_hidden_layers"] = 1e15.into()),
        ),
        (
            "image_token_id",
            Box::new(|c, _, _| c["image_token_id"] = 320.into()),
        ),
        (
            "image_token_id",
            Box::new(|c, _, _| c["image_token_id"] = (-1).into()),
        ),
        (
            "scale factor 3",
            Box::new(|c, _, _| c["scale_factor"] = 3.into()),
        ),
        (
            "vision_config.hidden_act",
            Box::new(|c, _, _| c["vision_config"]["hidden_act"] = "relu".into()),
        ),
        (
            "image_std",
            Box::new(|_, p, _| p["image_std"] = serde_json::json!([0.5, 0.0, 0.5])),
        ),
        (
            "rescale_factor",
            Box::new(|_, p, _| p["rescale_factor"] = 1.0.into()),
        ),
        (
            "text_config",
            Box::new(|c, _, _| {
                c.as_object_mut().unwrap().remove("text_config");
            }),
        ),
    ];
    for (want, edit) in cases {
        let dir = edited_hf_vlm(edit);
        let err = load_model(&ModelSource::Path(dir.path().to_path_buf()))
            .map(|m| m.name)
            .unwrap_err()
            .to_string();
        assert!(err.contains(want), "want `{want}` in: {err}");
    }
    // Without `image_token_id`, the tokenizer's `<image>` would stand in; the synthetic one has
    // none, so that is refused too.
    let dir = edited_hf_vlm(|c, _, _| {
        c.as_object_mut().unwrap().remove("image_token_id");
    });
    let err = load_model(&ModelSource::Path(dir.path().to_path_buf()))
        .map(|m| m.name)
        .unwrap_err()
        .to_string();
    assert!(err.contains("<image>"), "{err}");
    // Keys left out take transformers' defaults: `layer_norm_eps` 1e-6 is the synthetic one.
    let dir = edited_hf_vlm(|c, _, _| {
        c["vision_config"]
            .as_object_mut()
            .unwrap()
            .remove("layer_norm_eps");
    });
    let m = load_model(&ModelSource::Path(dir.path().to_path_buf())).unwrap();
    assert_eq!(m.vision.unwrap().config().layer_norm_eps, 1e-6);
}

/// The gradient image of `benches/idefics3_split_reference.py`.
fn gradient_png(w: u32, h: u32) -> Vec<u8> {
    let (wd, hd, sd) = ((w - 1).max(1), (h - 1).max(1), (w + h - 2).max(1));
    let img = image::RgbImage::from_fn(w, h, |x, y| {
        image::Rgb([
            (255 * x / wd) as u8,
            (255 * y / hd) as u8,
            (255 * (x + y) / sd) as u8,
        ])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

/// Image splitting against transformers' own answers (`gpu/tests/data/idefics3_split.json`,
/// written by `benches/idefics3_split_reference.py` from `Idefics3ImageProcessorPil` and
/// `Idefics3Processor`): for every settings and image size, the two resized sizes, the tile
/// grid, the prompt text of the image, the sub-images' sizes and order (each one's
/// per-channel mean of the normalized pixels, within resampling differences: Lanczos in the
/// `image` crate and in PIL).
#[test]
fn image_splitting_matches_transformers() {
    use pdserve_gpu::vision::{
        image_prompt_layout, plan_image, prepare_image_parts, ImageSplitting, PromptPiece, TileGrid,
    };
    let fixture: serde_json::Value =
        serde_json::from_str(include_str!("data/idefics3_split.json")).unwrap();
    let seq_len = fixture["seq_len"].as_u64().unwrap() as usize;
    let pair =
        |v: &serde_json::Value| (v[0].as_u64().unwrap() as u32, v[1].as_u64().unwrap() as u32);
    let base = synthetic_vlm().vision.unwrap().config().clone();
    let limits = ImageLimits {
        max_bytes: 64 << 20,
        ..ImageLimits::default()
    };
    let mut worst = 0f32;
    let cases = fixture["cases"].as_array().unwrap();
    assert!(cases.len() >= 20);
    for case in cases {
        let n = |k: &str| case[k].as_u64().unwrap() as usize;
        let split = ImageSplitting {
            longest_edge: n("longest_edge"),
            tile_size: n("tile"),
        };
        let (w, h) = (n("width") as u32, n("height") as u32);
        let tag = format!("{split:?} {w}x{h}");
        let resized = split.resized_size(w, h);
        assert_eq!(resized, pair(&case["resized"]), "{tag}: first resize");
        assert_eq!(
            split.tiled_size(resized.0, resized.1),
            pair(&case["tiled"]),
            "{tag}: second resize"
        );
        let grid = split.grid(w, h);
        assert_eq!(
            grid,
            TileGrid {
                rows: n("rows"),
                cols: n("cols")
            },
            "{tag}: grid"
        );
        // The prompt text transformers writes for the image.
        let text: String = image_prompt_layout(grid, true)
            .into_iter()
            .map(|p| match p {
                PromptPiece::Around => "<fake_token_around_image>".to_string(),
                PromptPiece::Global => "<global-img>".to_string(),
                PromptPiece::Tile { row, col } => format!("<row_{row}_col_{col}>"),
                PromptPiece::Text(t) => t.to_string(),
                PromptPiece::SubImage(_) => "<image>".repeat(seq_len),
            })
            .collect();
        assert_eq!(text, case["prompt"].as_str().unwrap(), "{tag}: prompt");
        // The sub-images, in order.
        let cfg = VisionConfig {
            image_size: split.tile_size,
            splitting: Some(split),
            ..base.clone()
        };
        let bytes = gradient_png(w, h);
        let (plan, parts) = prepare_image_parts(&bytes, &cfg, &limits).unwrap();
        assert_eq!(plan, plan_image(&bytes, &cfg, &limits).unwrap(), "{tag}");
        assert_eq!(plan.grid, grid);
        let frames = case["frames"].as_array().unwrap();
        assert_eq!(parts.len(), frames.len(), "{tag}: sub-images");
        assert_eq!(plan.parts.len(), frames.len());
        let t = split.tile_size as u32;
        for (i, (part, (frame, mean))) in parts
            .iter()
            .zip(frames.iter().zip(case["means"].as_array().unwrap()))
            .enumerate()
        {
            assert_eq!(pair(frame), (t, t), "{tag}: sub-image {i}");
            assert_eq!(part.digest, plan.parts[i]);
            let area = (t * t) as usize;
            for c in 0..3 {
                let ours = part.pixels[c * area..(c + 1) * area].iter().sum::<f32>() / area as f32;
                let theirs = mean[c].as_f64().unwrap() as f32;
                let d = (ours - theirs).abs();
                worst = worst.max(d);
                assert!(
                    d < 0.005,
                    "{tag}: sub-image {i} channel {c}: {ours} vs {theirs}"
                );
            }
        }
        // Sub-images are told apart; an image that is not cut keeps its own digest.
        let distinct: std::collections::HashSet<_> = plan.parts.iter().collect();
        assert_eq!(distinct.len(), plan.parts.len());
        assert_eq!(plan.parts.len() == 1, plan.parts[0] == plan.digest);
    }
    println!("largest difference of a sub-image's channel mean: {worst}");
}

/// A synthetic VLM with image splitting written as an HF directory loads with the same
/// splitting settings and wrapper tokens (from `preprocessor_config.json` and
/// `tokenizer.json`).
#[test]
fn an_hf_smolvlm_directory_with_splitting_loads_its_settings_and_tokens() {
    use pdserve_gpu::synthetic::{write_safetensors_dir, SyntheticSpec};
    let dir = tempfile::tempdir().unwrap();
    let spec = SyntheticSpec::parse("tiny,vision=1,split=1").unwrap();
    write_safetensors_dir(&spec, dir.path(), false).unwrap();
    let loaded = load_model(&ModelSource::Path(dir.path().to_path_buf())).unwrap();
    let tower = loaded.vision.unwrap();
    assert_eq!(Some(tower.config()), spec.vision.as_ref());
    assert!(tower.config().splitting.is_some() && tower.config().wrap.is_some());
}
