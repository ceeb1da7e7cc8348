//! Image input of a chat request (vision-language models), between the parsed request and the
//! Scheduler: `image_url` parts checked against the `[multimodal]` limits, decoded from their
//! `data:` URLs, preprocessed and encoded by the model's vision tower on a blocking thread,
//! and spliced into the prompt: each image's placeholder marker in the rendered chat becomes
//! its rows' placeholder tokens, and the image travels to the Scheduler as a
//! [`PromptImage`].
//!
//! With image splitting (SmolVLM, [`pdserve_gpu::vision::ImageSplitting`]) one image is
//! several sub-images — its tiles, then its global image — each encoded, cached and moved on
//! its own (an [`ImageEmbeds`] of its own digest), each its own [`PromptImage`] at its run of
//! placeholder tokens between the wrapper tokens ([`EncodedImage`], [`splice_prompt`]). A
//! request's sub-images are at most [`MAX_SUB_IMAGES`], what one encoder hold takes: counted
//! from the images' headers, before any pixel is decoded.
//!
//! Every refusal is a [`MultimodalError`] (a 400 naming the problem), raised before any work
//! the request could not pay for: the count before anything is decoded, a data URL's size
//! from its base64 length before it is decoded, an image's dimensions from its header before
//! its pixels are allocated.

use crate::error::RequestError;
use crate::openai::IMAGE_MARKER;
use crate::scheduler::PromptImage;
use base64::Engine as _;
use pdserve_gpu::vision::{
    image_prompt_layout, plan_image, ImageDigest, ImageEmbeds, ImageError, ImageLimits, ImagePlan,
    PromptPiece, TileGrid, VisionConfig, VisionTower, MAX_SUB_IMAGES,
};
use pdserve_runtime::config::MultimodalSection;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

/// Images (sub-images, with image splitting) whose embeddings came from the encoder cache (`result="hit"`) or were encoded
/// (`result="miss"`).
pub const ENCODER_CACHE_LOOKUPS_TOTAL: &str = "pdserve_encoder_cache_lookups_total";
/// Seconds to decode, preprocess and encode one image (cache misses).
pub const IMAGE_ENCODE_SECONDS: &str = "pdserve_image_encode_seconds";

// Every sub-image of a request fits one encoder hold.
const _: () = assert!(MAX_SUB_IMAGES <= crate::encode::protocol::MAX_HOLD_IMAGES);

/// One image of a request as the model takes it: its sub-images' embeddings (the tiles
/// row-major, then the global image; or the one image) and how it was cut.
#[derive(Clone, Debug)]
pub struct EncodedImage {
    /// How it was cut ([`TileGrid::WHOLE`]: not cut).
    pub grid: TileGrid,
    /// Its sub-images' embeddings, in prompt order.
    pub parts: Vec<Arc<ImageEmbeds>>,
}

impl EncodedImage {
    /// An image that is not cut.
    pub fn whole(embeds: Arc<ImageEmbeds>) -> Self {
        Self {
            grid: TileGrid::WHOLE,
            parts: vec![embeds],
        }
    }
}

/// Why a request's images were refused (each a 400).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MultimodalError {
    /// The served model has no vision tower.
    #[error("model `{0}` does not take image input (it is a text-only model)")]
    TextOnlyModel(String),
    /// More images than `multimodal.max_images_per_request`.
    #[error("{count} images in one request, more than the limit of {max} (multimodal.max_images_per_request)")]
    TooManyImages {
        /// Images sent.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// The images are cut into more sub-images (tiles and global images, image splitting)
    /// than one request may have.
    #[error("the request's images are {count} sub-images (each image's tiles and its global image), more than the limit of {max} one request may have: send fewer or smaller images")]
    TooManySubImages {
        /// Sub-images of the request.
        count: usize,
        /// The limit ([`MAX_SUB_IMAGES`]).
        max: usize,
    },
    /// An `http(s)://` image URL: pdserve does not fetch images.
    #[error("image {index}: remote image URLs are not fetched; send the image inline as a `data:image/png;base64,...` or `data:image/jpeg;base64,...` URL")]
    RemoteUrl {
        /// Which image (0-based, request order).
        index: usize,
    },
    /// Not a `data:` URL of a supported media type with base64 content.
    #[error("image {index}: {reason}")]
    BadUrl {
        /// Which image.
        index: usize,
        /// What is wrong.
        reason: String,
    },
    /// The base64 payload does not decode.
    #[error("image {index}: the base64 data does not decode: {reason}")]
    BadBase64 {
        /// Which image.
        index: usize,
        /// The decoder's message.
        reason: String,
    },
    /// The image itself was refused (size, dimensions, format, corrupt).
    #[error("image {index}: {source}")]
    Image {
        /// Which image.
        index: usize,
        /// Why.
        source: ImageError,
    },
    /// The rendered prompt does not hold one marker per image (the marker text was in a
    /// message, or the chat template dropped a message with an image).
    #[error("the prompt holds {markers} image places for {images} images: message text may not contain `{marker}`, and the chat template must keep every message with an image", marker = IMAGE_MARKER)]
    MarkerMismatch {
        /// Markers found in the rendered prompt.
        markers: usize,
        /// Images sent.
        images: usize,
    },
    /// A decode instance asked to drive its prefill instance itself (pdserve's proxy,
    /// `do_remote_prefill` without block ids): the peer protocol carries no images yet.
    #[error("images with a decode instance that drives its prefill instance (pdserve's one-hop P/D: do_remote_prefill without remote_block_ids) need an encode instance holding them (ec_transfer_params.encoder_url; `pdserve launch --encode N` or role = \"encode\"): the peer protocol carries images by reference. Or send image requests to a colocated instance, or through vLLM's two hops (do_remote_decode to prefill, then its kv_transfer_params to decode)")]
    NotColocated,
    /// Images with completions' `prompt`, or a prompt form that carries none.
    #[error("{0}")]
    Unsupported(String),
}

impl MultimodalError {
    /// A short, stable name for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::TextOnlyModel(_) => "text_only_model",
            Self::TooManyImages { .. } => "too_many_images",
            Self::TooManySubImages { .. } => "too_many_sub_images",
            Self::RemoteUrl { .. } => "remote_url",
            Self::BadUrl { .. } => "bad_url",
            Self::BadBase64 { .. } => "bad_base64",
            Self::Image { source, .. } => source.kind(),
            Self::MarkerMismatch { .. } => "marker_mismatch",
            Self::NotColocated => "not_colocated",
            Self::Unsupported(_) => "unsupported",
        }
    }
}

impl From<MultimodalError> for RequestError {
    fn from(e: MultimodalError) -> Self {
        RequestError::BadRequest(e.to_string())
    }
}

/// The limits of [`MultimodalSection`] as the vision crate takes them.
pub fn image_limits(cfg: &MultimodalSection) -> ImageLimits {
    ImageLimits {
        max_bytes: usize::try_from(cfg.max_image_bytes).unwrap_or(usize::MAX),
        max_width: cfg.max_image_width,
        max_height: cfg.max_image_height,
    }
}

/// The most body bytes a chat request with images may need: every image at its byte limit,
/// base64-encoded, plus 1 MiB of text. (axum's default of 2 MiB would refuse an in-limit
/// image with a 413 before it could be checked and named.)
pub fn body_limit(cfg: &MultimodalSection) -> usize {
    let per_image = usize::try_from(cfg.max_image_bytes)
        .unwrap_or(usize::MAX)
        .div_ceil(3)
        .saturating_mul(4)
        .saturating_add(64);
    per_image
        .saturating_mul(cfg.max_images_per_request)
        .saturating_add(1 << 20)
}

/// The bytes of image `index` from its URL: a `data:image/png;base64,...` or
/// `data:image/jpeg;base64,...` URL whose payload is within `max_bytes` (checked from its
/// length before it is decoded).
///
/// # Errors
/// [`MultimodalError::RemoteUrl`], [`MultimodalError::BadUrl`],
/// [`MultimodalError::BadBase64`], [`MultimodalError::Image`] (too many bytes).
pub fn data_url_bytes(
    index: usize,
    url: &str,
    max_bytes: usize,
) -> Result<Vec<u8>, MultimodalError> {
    let bad = |reason: &str| MultimodalError::BadUrl {
        index,
        reason: reason.to_string(),
    };
    let lower = url.get(..8).unwrap_or(url).to_ascii_lowercase();
    if lower.starts_with("http://") || lower.starts_with("https://") {
        return Err(MultimodalError::RemoteUrl { index });
    }
    let Some(rest) = url.strip_prefix("data:") else {
        return Err(bad(
            "the image URL must be a `data:` URL (data:image/png;base64,...)",
        ));
    };
    let Some((header, payload)) = rest.split_once(',') else {
        return Err(bad("the data URL has no `,` before its data"));
    };
    let mut params = header.split(';');
    let media = params
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    if !matches!(media.as_str(), "image/png" | "image/jpeg" | "image/jpg") {
        return Err(MultimodalError::Image {
            index,
            source: ImageError::Unsupported(format!(
                " `{}`",
                media.chars().take(64).collect::<String>()
            )),
        });
    }
    if !params.any(|p| p.trim().eq_ignore_ascii_case("base64")) {
        return Err(bad("the data URL must be base64 (`;base64,`)"));
    }
    let payload = payload.trim();
    // Decoded size from the length alone: 3 bytes per 4 characters, less the padding.
    let padding = payload
        .bytes()
        .rev()
        .take_while(|&b| b == b'=')
        .count()
        .min(2);
    let decoded = (payload.len() / 4 * 3).saturating_sub(padding) + payload.len() % 4;
    if decoded > max_bytes {
        return Err(MultimodalError::Image {
            index,
            source: ImageError::TooManyBytes {
                bytes: decoded,
                max: max_bytes,
            },
        });
    }
    base64::engine::general_purpose::STANDARD
        .decode(payload)
        .map_err(|e| MultimodalError::BadBase64 {
            index,
            reason: e.to_string(),
        })
}

/// The encoder cache: image embeddings by [`ImageDigest`] (the image's bytes and the
/// preprocessing settings), so an image sent again — a later turn of a conversation, another
/// request — is neither decoded nor encoded again. Bounded by the bytes of the embeddings it
/// holds; the least recently used entry is evicted first. A hit hands out the same
/// `Arc<ImageEmbeds>` (rows shared, not copied).
#[derive(Debug)]
pub struct EncoderCache {
    capacity: usize,
    inner: Mutex<CacheState>,
}

#[derive(Debug, Default)]
struct CacheState {
    entries: HashMap<ImageDigest, (Arc<ImageEmbeds>, u64)>,
    /// Last use → digest (oldest first).
    order: BTreeMap<u64, ImageDigest>,
    tick: u64,
    bytes: usize,
}

/// Counts of an [`EncoderCache`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EncoderCacheFigures {
    /// Images held.
    pub entries: usize,
    /// Bytes of their embeddings.
    pub bytes: usize,
}

impl EncoderCache {
    /// A cache of at most `capacity` bytes of embeddings (0: keeps nothing).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            inner: Mutex::new(CacheState::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CacheState> {
        // The state is consistent after every statement: a panic elsewhere leaves it usable.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The embeddings of `digest`, if held (and it becomes the most recently used).
    pub fn get(&self, digest: &ImageDigest) -> Option<Arc<ImageEmbeds>> {
        let mut s = self.lock();
        s.tick += 1;
        let tick = s.tick;
        let (embeds, last) = s.entries.get_mut(digest)?;
        let (embeds, old) = (embeds.clone(), std::mem::replace(last, tick));
        s.order.remove(&old);
        s.order.insert(tick, *digest);
        Some(embeds)
    }

    /// Keeps `embeds`, evicting the least recently used entries to fit; one larger than the
    /// whole cache is not kept.
    pub fn insert(&self, embeds: Arc<ImageEmbeds>) {
        let size = embeds.data.len() * std::mem::size_of::<f32>();
        if size > self.capacity {
            return;
        }
        let mut s = self.lock();
        if s.entries.contains_key(&embeds.digest) {
            return;
        }
        while s.bytes + size > self.capacity {
            let Some((_, oldest)) = s.order.pop_first() else {
                break;
            };
            if let Some((e, _)) = s.entries.remove(&oldest) {
                s.bytes -= e.data.len() * std::mem::size_of::<f32>();
            }
        }
        s.tick += 1;
        let tick = s.tick;
        s.order.insert(tick, embeds.digest);
        s.bytes += size;
        s.entries.insert(embeds.digest, (embeds, tick));
    }

    /// What it holds.
    pub fn figures(&self) -> EncoderCacheFigures {
        let s = self.lock();
        EncoderCacheFigures {
            entries: s.entries.len(),
            bytes: s.bytes,
        }
    }
}

/// Checks a request's image URLs and reads their headers: each image's bytes, and its plan
/// (digest, tile grid, sub-images' digests) for a tower of `vision`. Every URL is checked
/// before any header is read, and the sub-images are counted against [`MAX_SUB_IMAGES`]
/// before any pixel is decoded.
///
/// # Errors
/// [`MultimodalError::TooManyImages`], the first image refused, or
/// [`MultimodalError::TooManySubImages`].
pub fn plan_images(
    vision: &VisionConfig,
    cfg: &MultimodalSection,
    urls: &[String],
) -> Result<Vec<(Vec<u8>, ImagePlan)>, MultimodalError> {
    if urls.len() > cfg.max_images_per_request {
        return Err(MultimodalError::TooManyImages {
            count: urls.len(),
            max: cfg.max_images_per_request,
        });
    }
    let limits = image_limits(cfg);
    // Every URL is checked before any image is read: a bad last image costs nothing.
    let bytes = urls
        .iter()
        .enumerate()
        .map(|(i, u)| data_url_bytes(i, u, limits.max_bytes))
        .collect::<Result<Vec<_>, _>>()?;
    let mut out = Vec::with_capacity(bytes.len());
    let mut count = 0usize;
    for (index, b) in bytes.into_iter().enumerate() {
        let plan = plan_image(&b, vision, &limits)
            .map_err(|source| MultimodalError::Image { index, source })?;
        count += plan.parts.len();
        out.push((b, plan));
    }
    check_sub_images(count)?;
    Ok(out)
}

/// Refuses more than [`MAX_SUB_IMAGES`] sub-images in one request.
///
/// # Errors
/// [`MultimodalError::TooManySubImages`].
pub fn check_sub_images(count: usize) -> Result<(), MultimodalError> {
    if count > MAX_SUB_IMAGES {
        return Err(MultimodalError::TooManySubImages {
            count,
            max: MAX_SUB_IMAGES,
        });
    }
    Ok(())
}

/// Checks, decodes, preprocesses and encodes a request's images (request order), on the
/// calling thread: call it from a blocking task. A sub-image whose digest is in `cache` is
/// taken from there (after its URL, header and the request's sub-image count were checked
/// like any other); an image is decoded only when some of its sub-images are not, and those
/// are encoded and kept there.
///
/// # Errors
/// The first image refused, as a [`MultimodalError`]; an encoder failure as
/// [`RequestError::Internal`].
pub fn encode_images(
    tower: &VisionTower,
    cfg: &MultimodalSection,
    cache: &EncoderCache,
    urls: &[String],
) -> Result<Vec<EncodedImage>, RequestError> {
    let planned = plan_images(tower.config(), cfg, urls)?;
    let limits = image_limits(cfg);
    let mut out = Vec::with_capacity(planned.len());
    for (index, (b, plan)) in planned.iter().enumerate() {
        let mut parts: Vec<Option<Arc<ImageEmbeds>>> =
            plan.parts.iter().map(|d| cache.get(d)).collect();
        for p in &parts {
            let result = if p.is_some() { "hit" } else { "miss" };
            metrics::counter!(ENCODER_CACHE_LOOKUPS_TOTAL, "result" => result).increment(1);
        }
        if parts.iter().any(Option::is_none) {
            let started = std::time::Instant::now();
            let (_, prepared) =
                pdserve_gpu::vision::prepare_image_parts(b, tower.config(), &limits)
                    .map_err(|source| MultimodalError::Image { index, source })?;
            for (slot, image) in parts.iter_mut().zip(&prepared) {
                if slot.is_some() {
                    continue;
                }
                let embeds = tower.encode(image).map_err(|e| {
                    RequestError::Internal(format!("image {index}: vision encoder: {e}"))
                })?;
                let embeds = Arc::new(embeds);
                cache.insert(embeds.clone());
                *slot = Some(embeds);
            }
            metrics::histogram!(IMAGE_ENCODE_SECONDS).record(started.elapsed().as_secs_f64());
            tracing::debug!(image = index, digest = %plan.digest.short(), sub_images = parts.len(), rows = ?plan.grid, "image encoded");
        }
        out.push(EncodedImage {
            grid: plan.grid,
            parts: parts.into_iter().map(|p| p.expect("filled")).collect(),
        });
    }
    Ok(out)
}

/// Tokenizes a rendered chat whose image places are [`IMAGE_MARKER`]s: the text between them
/// is tokenized piece by piece (the marker is a boundary, as a VLM's image special tokens
/// are), and each marker becomes its image's layout for a tower of `vision`
/// ([`image_prompt_layout`]): each sub-image's rows as copies of the image token, between the
/// wrapper tokens when `vision` has them (the newlines between rows of tiles tokenized as
/// text). Returns the prompt and its sub-images at their positions.
///
/// # Errors
/// [`MultimodalError::MarkerMismatch`] when the text does not hold exactly one marker per
/// image; the tokenizer's message as [`RequestError::BadRequest`]; an image cut into a grid
/// the wrapper tokens do not cover (or cut without them) as [`RequestError::Internal`].
pub fn splice_prompt(
    tokenizer: &pdserve_gpu::Tokenizer,
    rendered: &str,
    images: &[EncodedImage],
    vision: &VisionConfig,
) -> Result<(Vec<u32>, Vec<PromptImage>), RequestError> {
    let pieces: Vec<&str> = rendered.split(IMAGE_MARKER).collect();
    if pieces.len() != images.len() + 1 {
        return Err(MultimodalError::MarkerMismatch {
            markers: pieces.len() - 1,
            images: images.len(),
        }
        .into());
    }
    let encode = |text: &str| {
        tokenizer
            .encode(text, false)
            .map_err(|e| RequestError::BadRequest(e.to_string()))
    };
    let mut prompt = Vec::new();
    let mut placed = Vec::with_capacity(images.iter().map(|i| i.parts.len()).sum());
    for (i, piece) in pieces.iter().enumerate() {
        if !piece.is_empty() {
            prompt.extend(encode(piece)?);
        }
        let Some(img) = images.get(i) else {
            continue;
        };
        let layout = image_prompt_layout(img.grid, vision.wrap.is_some());
        let wrap = vision.wrap.as_ref();
        let missing = || {
            RequestError::Internal(format!(
                "image {i} is cut {}x{}, which the wrapper tokens do not cover",
                img.grid.rows, img.grid.cols
            ))
        };
        for p in layout {
            match p {
                PromptPiece::Around => prompt.push(wrap.ok_or_else(missing)?.around),
                PromptPiece::Global => prompt.push(wrap.ok_or_else(missing)?.global),
                PromptPiece::Tile { row, col } => {
                    prompt.push(wrap.and_then(|w| w.tile(row, col)).ok_or_else(missing)?)
                }
                PromptPiece::Text(t) => prompt.extend(encode(t)?),
                PromptPiece::SubImage(k) => {
                    let embeds = img.parts.get(k).ok_or_else(missing)?;
                    placed.push(PromptImage {
                        at: prompt.len(),
                        embeds: embeds.clone(),
                    });
                    prompt.extend(std::iter::repeat_n(vision.image_token_id, embeds.rows));
                }
            }
        }
    }
    Ok((prompt, placed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_urls_are_checked_before_decoding() {
        let ok = "data:image/png;base64,AAECAw==";
        assert_eq!(data_url_bytes(0, ok, 4).unwrap(), vec![0, 1, 2, 3]);
        assert_eq!(
            data_url_bytes(0, ok, 3).unwrap_err().kind(),
            "image_too_many_bytes"
        );
        assert_eq!(
            data_url_bytes(1, "https://example.com/a.png", 9).unwrap_err(),
            MultimodalError::RemoteUrl { index: 1 }
        );
        assert_eq!(
            data_url_bytes(0, "HTTP://x", 9).unwrap_err().kind(),
            "remote_url"
        );
        assert_eq!(
            data_url_bytes(0, "data:image/gif;base64,AAAA", 9)
                .unwrap_err()
                .kind(),
            "image_unsupported"
        );
        assert_eq!(
            data_url_bytes(0, "data:image/png,AAAA", 9)
                .unwrap_err()
                .kind(),
            "bad_url"
        );
        assert_eq!(
            data_url_bytes(0, "data:image/png;base64,@@@@", 9)
                .unwrap_err()
                .kind(),
            "bad_base64"
        );
        assert_eq!(
            data_url_bytes(0, "file:///etc/passwd", 9)
                .unwrap_err()
                .kind(),
            "bad_url"
        );
        // The size bound from the length is never below the real size.
        for n in 0..20usize {
            let data: Vec<u8> = (0..n as u8).collect();
            let b64 = base64::engine::general_purpose::STANDARD.encode(&data);
            let url = format!("data:image/jpeg;base64,{b64}");
            assert_eq!(data_url_bytes(0, &url, n).unwrap(), data);
            if n > 0 {
                assert!(data_url_bytes(0, &url, n - 1).is_err(), "{n}");
            }
        }
    }

    fn embeds(tag: u8, rows: usize) -> Arc<ImageEmbeds> {
        Arc::new(ImageEmbeds {
            digest: ImageDigest([tag; 32]),
            rows,
            width: 4,
            data: vec![0.0; rows * 4],
        })
    }

    #[test]
    fn the_encoder_cache_keeps_the_most_recently_used_within_its_bytes() {
        // 16 bytes a row: room for 3 images of 2 rows.
        let c = EncoderCache::new(3 * 2 * 16);
        for t in 0..3 {
            c.insert(embeds(t, 2));
        }
        assert!(Arc::ptr_eq(
            &c.get(&ImageDigest([0; 32])).unwrap(),
            &c.get(&ImageDigest([0; 32])).unwrap()
        ));
        // Image 1 is now the oldest: a fourth evicts it.
        c.insert(embeds(3, 2));
        assert!(c.get(&ImageDigest([1; 32])).is_none());
        for t in [0, 2, 3] {
            assert!(c.get(&ImageDigest([t; 32])).is_some(), "{t}");
        }
        assert_eq!(
            c.figures(),
            EncoderCacheFigures {
                entries: 3,
                bytes: 96
            }
        );
        // Larger than the whole cache: not kept, nothing evicted.
        c.insert(embeds(9, 7));
        assert_eq!(c.figures().entries, 3);
        // A cache of 0 bytes keeps nothing.
        let off = EncoderCache::new(0);
        off.insert(embeds(1, 1));
        assert_eq!(off.figures(), EncoderCacheFigures::default());
    }

    #[test]
    fn a_cached_image_is_not_encoded_again() {
        let model = pdserve_gpu::loader::load_model(&pdserve_gpu::loader::ModelSource::Synthetic(
            "tiny,vision=1".into(),
        ))
        .unwrap();
        let tower = model.vision.unwrap();
        let png = |seed: u8| png_url(20, 20, seed);
        let cfg = MultimodalSection::default();
        let cache = EncoderCache::new(1 << 20);
        let first = encode_images(&tower, &cfg, &cache, &[png(1), png(2)]).unwrap();
        assert_eq!(cache.figures().entries, 2);
        let again = encode_images(&tower, &cfg, &cache, &[png(2), png(1)]).unwrap();
        assert!(Arc::ptr_eq(&again[0].parts[0], &first[1].parts[0]));
        assert!(Arc::ptr_eq(&again[1].parts[0], &first[0].parts[0]));
        // A cached image's URL is still checked (here: over the request's image count).
        let one = MultimodalSection {
            max_images_per_request: 1,
            ..cfg.clone()
        };
        assert!(encode_images(&tower, &one, &cache, &[png(1), png(1)]).is_err());
        // Uncached, the same bytes give the same rows.
        let fresh = encode_images(&tower, &cfg, &EncoderCache::new(0), &[png(1)]).unwrap();
        assert_eq!(fresh[0].parts[0].data, first[0].parts[0].data);
    }

    /// A PNG data URL whose pixels depend on `seed`.
    fn png_url(w: u32, h: u32, seed: u8) -> String {
        let img =
            image::RgbImage::from_fn(w, h, |x, y| image::Rgb([x as u8 ^ seed, y as u8, seed]));
        let mut out = std::io::Cursor::new(Vec::new());
        img.write_to(&mut out, image::ImageFormat::Png).unwrap();
        format!(
            "data:image/png;base64,{}",
            base64::engine::general_purpose::STANDARD.encode(out.into_inner())
        )
    }

    /// A synthetic VLM with image splitting: a 64x48 image is 2x2 tiles and its global image,
    /// each its own cached sub-image, laid out in the prompt between the wrapper tokens.
    #[test]
    fn a_split_image_is_its_tiles_and_global_image_between_the_wrapper_tokens() {
        let model = pdserve_gpu::loader::load_model(&pdserve_gpu::loader::ModelSource::Synthetic(
            "tiny,vision=1,split=1".into(),
        ))
        .unwrap();
        let tower = model.vision.unwrap();
        let vision = tower.config().clone();
        let cfg = MultimodalSection::default();
        let cache = EncoderCache::new(1 << 20);
        // transformers resizes every image to the longest edge (64) first: none stays whole.
        let urls = [png_url(64, 48, 1), png_url(20, 60, 2)];
        let images = encode_images(&tower, &cfg, &cache, &urls).unwrap();
        assert_eq!(images[0].grid, TileGrid { rows: 2, cols: 2 });
        assert_eq!(images[0].parts.len(), 5);
        assert_eq!(images[1].grid, TileGrid { rows: 2, cols: 1 });
        assert_eq!(images[1].parts.len(), 3);
        assert_eq!(cache.figures().entries, 8);
        // Again: every sub-image from the cache.
        let again = encode_images(&tower, &cfg, &cache, &urls[..1]).unwrap();
        for (a, b) in again[0].parts.iter().zip(&images[0].parts) {
            assert!(Arc::ptr_eq(a, b));
        }
        let rendered = format!("a{IMAGE_MARKER}b{IMAGE_MARKER}c");
        let (prompt, placed) =
            splice_prompt(&model.tokenizer, &rendered, &images, &vision).unwrap();
        let w = vision.wrap.clone().unwrap();
        let rows = vision.tokens_per_image();
        let text = |t: &str| model.tokenizer.encode(t, false).unwrap();
        let mut want = Vec::new();
        let mut at = Vec::new();
        for (t, img) in ["a", "b"].into_iter().zip(&images) {
            want.extend(text(t));
            let g = img.grid;
            for r in 1..=g.rows {
                for c in 1..=g.cols {
                    want.extend([w.around, w.tile(r, c).unwrap()]);
                    at.push(want.len());
                    want.extend(vec![vision.image_token_id; rows]);
                }
                want.extend(text(if r == g.rows { "\n\n" } else { "\n" }));
            }
            want.extend([w.around, w.global]);
            at.push(want.len());
            want.extend(vec![vision.image_token_id; rows]);
            want.push(w.around);
        }
        want.extend(text("c"));
        assert_eq!(prompt, want);
        assert_eq!(placed.iter().map(|p| p.at).collect::<Vec<_>>(), at);
        let digests: Vec<_> = images
            .iter()
            .flat_map(|i| &i.parts)
            .map(|e| e.digest)
            .collect();
        assert_eq!(
            placed.iter().map(|p| p.embeds.digest).collect::<Vec<_>>(),
            digests
        );
    }

    #[test]
    fn a_request_of_too_many_sub_images_is_refused_before_decoding() {
        let vision = pdserve_gpu::synthetic::SyntheticSpec::parse("tiny,vision=1,split=1")
            .unwrap()
            .vision
            .unwrap();
        assert_eq!(vision.max_sub_images(), 5);
        let cfg = MultimodalSection {
            max_images_per_request: 64,
            ..MultimodalSection::default()
        };
        // 12 images of 5 sub-images fit (60); 13 (65) do not, named as such.
        let url = png_url(64, 48, 3);
        assert_eq!(
            plan_images(&vision, &cfg, &vec![url.clone(); 12])
                .unwrap()
                .len(),
            12
        );
        let e = plan_images(&vision, &cfg, &vec![url.clone(); 13]).unwrap_err();
        assert_eq!(
            e,
            MultimodalError::TooManySubImages {
                count: 65,
                max: MAX_SUB_IMAGES
            }
        );
        assert_eq!(e.kind(), "too_many_sub_images");
        assert!(e.to_string().contains("65 sub-images"), "{e}");
        // Tall images are 2x1 tiles and the global image: 21 fit, 22 do not.
        let tall = png_url(20, 60, 4);
        assert!(plan_images(&vision, &cfg, &vec![tall.clone(); 21]).is_ok());
        assert!(plan_images(&vision, &cfg, &vec![tall; 22]).is_err());
        assert!(check_sub_images(MAX_SUB_IMAGES).is_ok());
        assert!(check_sub_images(MAX_SUB_IMAGES + 1).is_err());
        // A corrupt image after good ones: refused by its header, by index.
        let mut urls = vec![url; 2];
        urls.push("data:image/png;base64,iVBORw0KGgo=".into());
        let e = plan_images(&vision, &cfg, &urls).unwrap_err();
        assert!(
            matches!(e, MultimodalError::Image { index: 2, .. }),
            "{e:?}"
        );
    }

    #[test]
    fn the_body_limit_fits_every_image_at_its_limit() {
        let cfg = MultimodalSection::default();
        assert!(
            body_limit(&cfg) > cfg.max_images_per_request * cfg.max_image_bytes as usize * 4 / 3
        );
    }
}
