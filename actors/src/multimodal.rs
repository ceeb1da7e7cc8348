//! Image input of a chat request (vision-language models), between the parsed request and the
//! Scheduler: `image_url` parts checked against the `[multimodal]` limits, decoded from their
//! `data:` URLs, preprocessed and encoded by the model's vision tower on a blocking thread,
//! and spliced into the prompt: each image's placeholder marker in the rendered chat becomes
//! its rows' placeholder tokens, and the image travels to the Scheduler as a
//! [`PromptImage`].
//!
//! Every refusal is a [`MultimodalError`] (a 400 naming the problem), raised before any work
//! the request could not pay for: the count before anything is decoded, a data URL's size
//! from its base64 length before it is decoded, an image's dimensions from its header before
//! its pixels are allocated.

use crate::error::RequestError;
use crate::openai::IMAGE_MARKER;
use crate::scheduler::PromptImage;
use base64::Engine as _;
use pdserve_gpu::vision::{ImageEmbeds, ImageError, ImageLimits, VisionTower};
use pdserve_runtime::config::MultimodalSection;
use std::sync::Arc;

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
    /// A request of another role than colocated (P/D with images is not built yet).
    #[error("image input is served by colocated instances only for now (prefill/decode hand-off of image prompts is not built yet)")]
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

/// Checks, decodes, preprocesses and encodes a request's images (request order), on the
/// calling thread: call it from a blocking task.
///
/// # Errors
/// The first image refused, as a [`MultimodalError`]; an encoder failure as
/// [`RequestError::Internal`].
pub fn encode_images(
    tower: &VisionTower,
    cfg: &MultimodalSection,
    urls: &[String],
) -> Result<Vec<Arc<ImageEmbeds>>, RequestError> {
    if urls.len() > cfg.max_images_per_request {
        return Err(MultimodalError::TooManyImages {
            count: urls.len(),
            max: cfg.max_images_per_request,
        }
        .into());
    }
    let limits = image_limits(cfg);
    // Every URL is checked before any image is decoded: a bad last image costs nothing.
    let bytes = urls
        .iter()
        .enumerate()
        .map(|(i, u)| data_url_bytes(i, u, limits.max_bytes))
        .collect::<Result<Vec<_>, _>>()?;
    let mut out = Vec::with_capacity(bytes.len());
    for (index, b) in bytes.iter().enumerate() {
        let prepared = pdserve_gpu::vision::prepare_image(b, tower.config(), &limits)
            .map_err(|source| MultimodalError::Image { index, source })?;
        let embeds = tower
            .encode(&prepared)
            .map_err(|e| RequestError::Internal(format!("image {index}: vision encoder: {e}")))?;
        tracing::debug!(image = index, digest = %prepared.digest.short(), rows = embeds.rows, "image encoded");
        out.push(Arc::new(embeds));
    }
    Ok(out)
}

/// Tokenizes a rendered chat whose image places are [`IMAGE_MARKER`]s: the text between them
/// is tokenized piece by piece (the marker is a boundary, as a VLM's image special tokens
/// are), and each marker becomes `rows` copies of `image_token`. Returns the prompt and its
/// images at their positions.
///
/// # Errors
/// [`MultimodalError::MarkerMismatch`] when the text does not hold exactly one marker per
/// image; the tokenizer's message as [`RequestError::BadRequest`].
pub fn splice_prompt(
    tokenizer: &pdserve_gpu::Tokenizer,
    rendered: &str,
    images: &[Arc<ImageEmbeds>],
    image_token: u32,
) -> Result<(Vec<u32>, Vec<PromptImage>), RequestError> {
    let pieces: Vec<&str> = rendered.split(IMAGE_MARKER).collect();
    if pieces.len() != images.len() + 1 {
        return Err(MultimodalError::MarkerMismatch {
            markers: pieces.len() - 1,
            images: images.len(),
        }
        .into());
    }
    let mut prompt = Vec::new();
    let mut placed = Vec::with_capacity(images.len());
    for (i, piece) in pieces.iter().enumerate() {
        if !piece.is_empty() {
            let ids = tokenizer
                .encode(piece, false)
                .map_err(|e| RequestError::BadRequest(e.to_string()))?;
            prompt.extend(ids);
        }
        if let Some(img) = images.get(i) {
            placed.push(PromptImage {
                at: prompt.len(),
                embeds: img.clone(),
            });
            prompt.extend(std::iter::repeat_n(image_token, img.rows));
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

    #[test]
    fn the_body_limit_fits_every_image_at_its_limit() {
        let cfg = MultimodalSection::default();
        assert!(
            body_limit(&cfg) > cfg.max_images_per_request * cfg.max_image_bytes as usize * 4 / 3
        );
    }
}
