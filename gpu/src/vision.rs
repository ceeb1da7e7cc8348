//! The vision side of a vision-language model: image preprocessing and the vision tower that
//! turns an image into rows of the decoder's input embeddings.
//!
//! The layout is **SmolVLM's (Idefics3)**, the VLM built on this project's default decoder
//! (SmolLM2): a **SigLIP** vision transformer and the Idefics3 connector.
//!
//! - *Patch embedding*: a `P×P` convolution with stride `P` over the `3×S×S` image, computed as
//!   one matmul of the `(S/P)²` flattened patches (`[3, P, P]` each, the convolution weight's
//!   own order) by the `[hidden, 3·P·P]` weight, plus its bias; then a learned position
//!   embedding per patch (SigLIP has no class token).
//! - *Encoder layers*, pre-norm: `x += attn(LN1(x))`, `x += fc2(gelu_tanh(fc1(LN2(x))))`, with
//!   bidirectional multi-head attention (Q/K/V/out projections with biases, scale
//!   `head_dim^-1/2`); then the post-layernorm.
//! - *Connector*: pixel shuffle by the scale factor `r` (each `r×r` group of neighbouring patch
//!   features becomes one feature of `hidden·r²`, HF `Idefics3Connector.pixel_shuffle`),
//!   then one linear projection without bias into the decoder's hidden size. An image becomes
//!   `(S/P)² / r²` rows.
//!
//! Tensor names are those of llama.cpp's `mmproj` files for this projector type (`idefics3`):
//! `v.patch_embd.*`, `v.position_embd.weight`, `v.blk.{i}.{ln1,attn_q,attn_k,attn_v,attn_out,
//! ln2,ffn_up,ffn_down}.*`, `v.post_ln.*`, `mm.model.fc.weight`. Three sources fill that
//! [`TensorStore`]: the seeded synthetic tower ([`crate::synthetic`], `synthetic:...,vision=1`),
//! an `mmproj` GGUF ([`crate::mmproj`]) and an HF Idefics3 / SmolVLM checkpoint directory
//! ([`crate::hf_vlm`], its `model.vision_model.*` and `model.connector.*` tensors renamed).
//!
//! Without splitting ([`VisionConfig::splitting`] `None`), an image is one global image:
//! decoded (PNG or JPEG only), converted to RGB, resized to `S×S` (bilinear), rescaled to
//! `[0, 1]` and normalized with the tower's mean and standard deviation. Every image is
//! identified by [`ImageDigest`]: SHA-256 of the preprocessing settings and the image's bytes,
//! which the prefix cache mixes into the hashes of the blocks the image's rows occupy.
//!
//! With **image splitting** ([`ImageSplitting`], transformers' `Idefics3ImageProcessor` with
//! `do_image_splitting`), an image becomes several **sub-images** of `S×S`, each encoded
//! alone into its own [`ImageEmbeds`] of [`VisionConfig::tokens_per_image`] rows and with its
//! own digest ([`ImageDigest::part`]): resized (Lanczos) so its longest edge is
//! `size.longest_edge`, resized again so each side is a multiple of the tile side
//! (`max_image_size.longest_edge` = `S`), cut into a grid of tiles in row-major order, plus
//! the whole image resized to `S×S` as the global image, last. An image whose second resize is
//! `S×S` is not cut: it is its global image alone ([`TileGrid`] of 0×0). In the prompt, each
//! sub-image's rows sit between wrapper tokens ([`image_prompt_layout`], transformers'
//! `Idefics3Processor`): `<fake_token_around_image><row_R_col_C>` + rows per tile, a newline
//! after each row of tiles, then `\n<fake_token_around_image><global-img>` + rows +
//! `<fake_token_around_image>`.

use crate::weights::TensorStore;
use crate::{ModelError, Result};
use candle_core::{DType, Device, Tensor, D};
use sha2::{Digest, Sha256};
use std::sync::Arc;

/// Architecture of a vision tower and how its images are prepared.
#[derive(Clone, Debug, PartialEq)]
pub struct VisionConfig {
    /// Side of the square image the tower takes (`S`).
    pub image_size: usize,
    /// Side of one patch (`P`).
    pub patch_size: usize,
    /// Width of the tower's features.
    pub hidden_size: usize,
    /// Encoder layers.
    pub num_layers: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// LayerNorm epsilon.
    pub layer_norm_eps: f32,
    /// Pixel-shuffle factor of the connector (`r`).
    pub scale_factor: usize,
    /// The decoder's hidden size (the projector's output).
    pub text_hidden_size: usize,
    /// Per-channel mean subtracted after rescaling to `[0, 1]`.
    pub image_mean: [f32; 3],
    /// Per-channel standard deviation divided by after that.
    pub image_std: [f32; 3],
    /// The decoder token that stands for one image row in a prompt.
    pub image_token_id: u32,
    /// Image splitting (`None`: an image is one global image).
    pub splitting: Option<ImageSplitting>,
    /// The tokens wrapped around an image's rows in a prompt (`None`: none, the rows alone;
    /// required with [`VisionConfig::splitting`]).
    pub wrap: Option<ImageWrapTokens>,
}

impl VisionConfig {
    /// Patches per side (`S / P`).
    pub fn patches_per_side(&self) -> usize {
        self.image_size / self.patch_size
    }

    /// Patches of one image.
    pub fn num_patches(&self) -> usize {
        self.patches_per_side() * self.patches_per_side()
    }

    /// Rows (decoder positions) one image takes: patches over `r²`.
    pub fn tokens_per_image(&self) -> usize {
        self.num_patches() / (self.scale_factor * self.scale_factor)
    }

    /// The preprocessing settings as text: part of every [`ImageDigest`], so one image
    /// prepared two ways never shares an identity.
    pub fn preprocessing_key(&self) -> String {
        let base = format!(
            "size={};resize=triangle;rescale=1/255;mean={:?};std={:?}",
            self.image_size, self.image_mean, self.image_std
        );
        match &self.splitting {
            None => base,
            Some(s) => format!("{base};{}", s.key()),
        }
    }

    /// How many sub-images at most one image becomes (1 without splitting).
    pub fn max_sub_images(&self) -> usize {
        self.splitting
            .map_or(1, |s| s.max_grid_side() * s.max_grid_side() + 1)
    }

    /// Checks the shape is one the tower can run.
    ///
    /// # Errors
    /// [`ModelError::BadMetadata`] naming the bad field.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(ModelError::BadMetadata(m));
        if self.patch_size == 0
            || self.image_size == 0
            || !self.image_size.is_multiple_of(self.patch_size)
        {
            return bad(format!(
                "vision image size {} is not a multiple of the patch size {}",
                self.image_size, self.patch_size
            ));
        }
        if self.scale_factor == 0 || !self.patches_per_side().is_multiple_of(self.scale_factor) {
            return bad(format!(
                "vision scale factor {} does not divide {} patches per side",
                self.scale_factor,
                self.patches_per_side()
            ));
        }
        if self.num_heads == 0 || !self.hidden_size.is_multiple_of(self.num_heads) {
            return bad(format!(
                "vision hidden size {} is not a multiple of {} heads",
                self.hidden_size, self.num_heads
            ));
        }
        if self.image_std.contains(&0.0) {
            return bad("vision image_std has a zero".into());
        }
        if let Some(split) = &self.splitting {
            split.validate(self.image_size)?;
            let side = split.max_grid_side();
            match &self.wrap {
                None => {
                    return bad(format!(
                        "image splitting needs the tokenizer's {FAKE_TOKEN_AROUND_IMAGE}, {GLOBAL_IMAGE_TOKEN} and <row_R_col_C> tokens (R, C up to {side})"
                    ))
                }
                Some(w) if w.grid_side < side => {
                    return bad(format!(
                        "image splitting with size.longest_edge {} and tiles of {} cuts up to {side}x{side} tiles, but the tokenizer has <row_R_col_C> tokens up to {}",
                        split.longest_edge, split.tile_size, w.grid_side
                    ))
                }
                Some(_) => {}
            }
        }
        Ok(())
    }
}

/// The name of the token around an image's rows (transformers' Idefics3 processor's).
pub const FAKE_TOKEN_AROUND_IMAGE: &str = "<fake_token_around_image>";
/// The name of the token before the global image's rows.
pub const GLOBAL_IMAGE_TOKEN: &str = "<global-img>";
/// Most sub-images (tiles and the global image) one image may become: the most a request's
/// images may be in all, and what one encoder hold takes.
pub const MAX_SUB_IMAGES: usize = 64;
/// Largest `size.longest_edge` (transformers' `MAX_IMAGE_SIZE`).
pub const MAX_LONGEST_EDGE: usize = 4096;

/// The name of the token before tile (`row`, `col`), both 1-based: `<row_1_col_1>`.
pub fn tile_token_name(row: usize, col: usize) -> String {
    format!("<row_{row}_col_{col}>")
}

/// Idefics3 / SmolVLM image splitting: transformers' `Idefics3ImageProcessor` with
/// `do_image_splitting` (`preprocessor_config.json`'s `size` and `max_image_size`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageSplitting {
    /// `size.longest_edge`: an image's longest edge is resized to this before it is cut.
    pub longest_edge: usize,
    /// `max_image_size.longest_edge`: the side of a tile and of the global image (the
    /// tower's `image_size`).
    pub tile_size: usize,
}

/// How an image is cut: `rows`×`cols` tiles plus the global image, or (0×0) the global image
/// alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct TileGrid {
    /// Rows of tiles (0: not cut).
    pub rows: usize,
    /// Columns of tiles (0: not cut).
    pub cols: usize,
}

impl TileGrid {
    /// The grid of an image that is not cut.
    pub const WHOLE: TileGrid = TileGrid { rows: 0, cols: 0 };

    /// Sub-images: the tiles and the global image.
    pub fn sub_images(&self) -> usize {
        self.rows * self.cols + 1
    }
}

impl ImageSplitting {
    /// The settings as text (part of [`VisionConfig::preprocessing_key`] and of every
    /// sub-image's digest).
    pub fn key(&self) -> String {
        format!(
            "split=idefics3;longest_edge={};tile={};resize=lanczos3",
            self.longest_edge, self.tile_size
        )
    }

    /// The most tiles on a side: an image resized to `longest_edge` (rounded up to even, as
    /// transformers does the short side) and then up to multiples of the tile.
    /// 0 when no image is ever cut (the longest edge fits one tile).
    pub fn max_grid_side(&self) -> usize {
        let edge = self.longest_edge + self.longest_edge % 2;
        match edge.div_ceil(self.tile_size.max(1)) {
            0 | 1 => 0,
            side => side,
        }
    }

    /// Checks the settings fit a tower of `image_size` and the bounds.
    ///
    /// # Errors
    /// [`ModelError::BadMetadata`] naming the bad setting.
    pub fn validate(&self, image_size: usize) -> Result<()> {
        let bad = |m: String| Err(ModelError::BadMetadata(m));
        if self.tile_size != image_size {
            return bad(format!(
                "image splitting: max_image_size.longest_edge {} is not the vision tower's image size {image_size}",
                self.tile_size
            ));
        }
        if !(1..=MAX_LONGEST_EDGE).contains(&self.longest_edge) {
            return bad(format!(
                "image splitting: size.longest_edge {} is not in 1..={MAX_LONGEST_EDGE}",
                self.longest_edge
            ));
        }
        let side = self.max_grid_side();
        if side * side + 1 > MAX_SUB_IMAGES {
            return bad(format!(
                "image splitting: size.longest_edge {} over tiles of {} cuts an image into up to {side}x{side} tiles plus the global image, more than {MAX_SUB_IMAGES} sub-images",
                self.longest_edge, self.tile_size
            ));
        }
        Ok(())
    }

    /// An image of `width`×`height` after the first resize: its longest edge to
    /// `longest_edge`, the other side by the aspect ratio, truncated and rounded up to even,
    /// at least 1 (transformers' `_resize_output_size_rescale_to_max_len`, then
    /// `_resize_output_size_scale_below_upper_bound` at [`MAX_LONGEST_EDGE`]).
    pub fn resized_size(&self, width: u32, height: u32) -> (u32, u32) {
        let (w, h) = (f64::from(width.max(1)), f64::from(height.max(1)));
        let max_len = self.longest_edge as f64;
        let aspect = w / h;
        let (mut w, mut h) = if w >= h {
            let mut h = (max_len / aspect).trunc();
            if h % 2.0 != 0.0 {
                h += 1.0;
            }
            (max_len, h)
        } else {
            let mut w = (max_len * aspect).trunc();
            if w % 2.0 != 0.0 {
                w += 1.0;
            }
            (w, max_len)
        };
        (w, h) = (w.max(1.0), h.max(1.0));
        let upper = MAX_LONGEST_EDGE as f64;
        let aspect = w / h;
        if w >= h && w > upper {
            (w, h) = (upper, (upper / aspect).trunc());
        } else if h > w && h > upper {
            (w, h) = ((upper * aspect).trunc(), upper);
        }
        (w.max(1.0) as u32, h.max(1.0) as u32)
    }

    /// An image of `width`×`height` (after [`ImageSplitting::resized_size`]) after the second
    /// resize: each side up to a multiple of the tile (transformers'
    /// `resize_for_vision_encoder`: the longer side rounded up, the other from it by the aspect
    /// ratio, truncated, then rounded up).
    pub fn tiled_size(&self, width: u32, height: u32) -> (u32, u32) {
        let t = self.tile_size as f64;
        let (w, h) = (f64::from(width.max(1)), f64::from(height.max(1)));
        let aspect = w / h;
        let up = |x: f64| (x / t).ceil() * t;
        let (w, h) = if w >= h {
            let w = up(w);
            (w, up((w / aspect).trunc()))
        } else {
            let h = up(h);
            (up((h * aspect).trunc()), h)
        };
        (w as u32, h as u32)
    }

    /// How an image of `width`×`height` (as sent) is cut.
    pub fn grid(&self, width: u32, height: u32) -> TileGrid {
        let (w, h) = self.resized_size(width, height);
        let (w, h) = self.tiled_size(w, h);
        let t = self.tile_size as u32;
        if w > t || h > t {
            TileGrid {
                rows: (h / t) as usize,
                cols: (w / t) as usize,
            }
        } else {
            TileGrid::WHOLE
        }
    }
}

/// The tokenizer's ids of the tokens wrapped around an image's rows in a prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageWrapTokens {
    /// `<fake_token_around_image>`.
    pub around: u32,
    /// `<global-img>`.
    pub global: u32,
    /// Tiles per side the tile tokens cover.
    pub grid_side: usize,
    /// `<row_R_col_C>` at `(R-1)·grid_side + (C-1)`.
    pub tiles: Vec<u32>,
}

impl ImageWrapTokens {
    /// The wrapper tokens for grids up to `grid_side`×`grid_side`, looked up by name with
    /// `id_of` (a tokenizer's `token_to_id`).
    ///
    /// # Errors
    /// The name of the first token `id_of` does not know.
    pub fn lookup(
        id_of: impl Fn(&str) -> Option<u32>,
        grid_side: usize,
    ) -> std::result::Result<Self, String> {
        let get = |name: &str| id_of(name).ok_or_else(|| name.to_string());
        let mut tiles = Vec::with_capacity(grid_side * grid_side);
        for r in 1..=grid_side {
            for c in 1..=grid_side {
                tiles.push(get(&tile_token_name(r, c))?);
            }
        }
        Ok(Self {
            around: get(FAKE_TOKEN_AROUND_IMAGE)?,
            global: get(GLOBAL_IMAGE_TOKEN)?,
            grid_side,
            tiles,
        })
    }

    /// The token of tile (`row`, `col`), both 1-based; `None` past the table.
    pub fn tile(&self, row: usize, col: usize) -> Option<u32> {
        if row == 0 || col == 0 || row > self.grid_side || col > self.grid_side {
            return None;
        }
        self.tiles
            .get((row - 1) * self.grid_side + (col - 1))
            .copied()
    }

    /// Every id (for a check against the vocabulary).
    pub fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        [self.around, self.global]
            .into_iter()
            .chain(self.tiles.iter().copied())
    }
}

/// One piece of an image's place in a prompt ([`image_prompt_layout`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PromptPiece {
    /// `<fake_token_around_image>`.
    Around,
    /// `<global-img>`.
    Global,
    /// `<row_R_col_C>` (1-based).
    Tile {
        /// Row R.
        row: usize,
        /// Column C.
        col: usize,
    },
    /// Text, tokenized as such (`"\n"`, `"\n\n"`).
    Text(&'static str),
    /// The rows of sub-image `k` (tiles row-major, then the global image).
    SubImage(usize),
}

/// The place of an image cut as `grid` in a prompt, as transformers' `Idefics3Processor`
/// writes it (with `wrap`; without, the one sub-image's rows alone). The newline after the
/// last row of tiles and the one before the global image are one `"\n\n"` piece, as the
/// tokenizer sees them (between two special tokens).
pub fn image_prompt_layout(grid: TileGrid, wrap: bool) -> Vec<PromptPiece> {
    use PromptPiece::*;
    if !wrap {
        return vec![SubImage(0)];
    }
    if grid.rows == 0 || grid.cols == 0 {
        return vec![Around, Global, SubImage(0), Around];
    }
    let mut out = Vec::with_capacity(grid.rows * (grid.cols * 3 + 1) + 4);
    for r in 0..grid.rows {
        for c in 0..grid.cols {
            out.extend([
                Around,
                Tile {
                    row: r + 1,
                    col: c + 1,
                },
                SubImage(r * grid.cols + c),
            ]);
        }
        out.push(Text(if r + 1 == grid.rows { "\n\n" } else { "\n" }));
    }
    out.extend([Around, Global, SubImage(grid.rows * grid.cols), Around]);
    out
}

/// What an image request may be: checked before and while an image is decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageLimits {
    /// Most bytes of one encoded image.
    pub max_bytes: usize,
    /// Widest image.
    pub max_width: u32,
    /// Tallest image.
    pub max_height: u32,
}

impl Default for ImageLimits {
    fn default() -> Self {
        Self {
            max_bytes: 8 << 20,
            max_width: 4096,
            max_height: 4096,
        }
    }
}

/// Why an image was refused. Each variant has a stable [`ImageError::kind`].
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ImageError {
    /// More encoded bytes than [`ImageLimits::max_bytes`].
    #[error("image is {bytes} bytes, more than the limit of {max} bytes")]
    TooManyBytes {
        /// Its size.
        bytes: usize,
        /// The limit.
        max: usize,
    },
    /// Wider or taller than the limits.
    #[error("image is {width}x{height} pixels, more than the limit of {max_width}x{max_height}")]
    TooLarge {
        /// Its width.
        width: u32,
        /// Its height.
        height: u32,
        /// Widest allowed.
        max_width: u32,
        /// Tallest allowed.
        max_height: u32,
    },
    /// Not a PNG or JPEG image.
    #[error("unsupported image format{0} (PNG and JPEG are accepted)")]
    Unsupported(String),
    /// The bytes do not decode as the image they claim to be.
    #[error("image does not decode: {0}")]
    Decode(String),
}

impl ImageError {
    /// A short, stable name for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::TooManyBytes { .. } => "image_too_many_bytes",
            Self::TooLarge { .. } => "image_too_large",
            Self::Unsupported(_) => "image_unsupported",
            Self::Decode(_) => "image_decode",
        }
    }
}

/// SHA-256 of an image's preprocessing settings and bytes: the image's identity in the
/// prefix cache (and, later, the encoder cache).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ImageDigest(pub [u8; 32]);

impl ImageDigest {
    /// The digest of `bytes` prepared with `settings` ([`VisionConfig::preprocessing_key`]).
    pub fn of(settings: &str, bytes: &[u8]) -> Self {
        let mut h = Sha256::new();
        h.update(b"pdserve-image/1\0");
        h.update((settings.len() as u64).to_le_bytes());
        h.update(settings.as_bytes());
        h.update(bytes);
        Self(h.finalize().into())
    }

    /// The digest of sub-image `index` of `count` of the image of this digest, cut with
    /// `splitting` ([`ImageSplitting::key`]): what the encoder cache, the prefix cache and an
    /// encoder hold know a tile or a global image by.
    pub fn part(&self, index: usize, count: usize, splitting: &str) -> Self {
        let mut h = Sha256::new();
        h.update(b"pdserve-image-part/1\0");
        h.update(self.0);
        h.update((splitting.len() as u64).to_le_bytes());
        h.update(splitting.as_bytes());
        h.update((index as u64).to_le_bytes());
        h.update((count as u64).to_le_bytes());
        Self(h.finalize().into())
    }

    /// The digest as eight 32-bit words (what a prompt's cache key holds in place of an
    /// image's placeholder tokens).
    pub fn words(&self) -> [u32; 8] {
        std::array::from_fn(|i| {
            u32::from_le_bytes(self.0[4 * i..4 * i + 4].try_into().expect("4 bytes"))
        })
    }

    /// Hex of the first 8 bytes (logs).
    pub fn short(&self) -> String {
        self.0[..8].iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// An image decoded and normalized for the tower.
#[derive(Clone, Debug)]
pub struct PreparedImage {
    /// Its identity.
    pub digest: ImageDigest,
    /// Width and height as sent.
    pub original_size: (u32, u32),
    /// `[3, S, S]` normalized pixel values, channel-major.
    pub pixels: Vec<f32>,
}

/// What an image becomes, known from its header alone (before any pixel is decoded): its
/// identity, its size, how it is cut and its sub-images' identities.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImagePlan {
    /// The image's digest ([`ImageDigest::of`] the preprocessing settings and its bytes).
    pub digest: ImageDigest,
    /// Width and height as sent.
    pub original_size: (u32, u32),
    /// How it is cut ([`TileGrid::WHOLE`] without splitting).
    pub grid: TileGrid,
    /// Its sub-images' digests: the tiles row-major, then the global image. An image that is
    /// not cut is its own one sub-image, of its own digest.
    pub parts: Vec<ImageDigest>,
}

/// Checks an image's byte count, format and dimensions (from its header) against `limits`.
fn check_header(
    bytes: &[u8],
    limits: &ImageLimits,
) -> std::result::Result<(image::ImageFormat, u32, u32), ImageError> {
    use image::{ImageFormat, ImageReader};
    if bytes.len() > limits.max_bytes {
        return Err(ImageError::TooManyBytes {
            bytes: bytes.len(),
            max: limits.max_bytes,
        });
    }
    let format = match image::guess_format(bytes) {
        Ok(f @ (ImageFormat::Png | ImageFormat::Jpeg)) => f,
        Ok(other) => return Err(ImageError::Unsupported(format!(" {other:?}"))),
        Err(_) => return Err(ImageError::Unsupported(String::new())),
    };
    let (width, height) = ImageReader::with_format(std::io::Cursor::new(bytes), format)
        .into_dimensions()
        .map_err(|e| ImageError::Decode(e.to_string()))?;
    if width > limits.max_width || height > limits.max_height {
        return Err(ImageError::TooLarge {
            width,
            height,
            max_width: limits.max_width,
            max_height: limits.max_height,
        });
    }
    Ok((format, width, height))
}

/// Decodes an image whose header passed [`check_header`], the decoder held to `limits`.
fn decode_checked(
    bytes: &[u8],
    format: image::ImageFormat,
    limits: &ImageLimits,
) -> std::result::Result<image::DynamicImage, ImageError> {
    let mut decoder_limits = image::Limits::default();
    decoder_limits.max_image_width = Some(limits.max_width);
    decoder_limits.max_image_height = Some(limits.max_height);
    // RGBA16 of the largest allowed image, and no more.
    decoder_limits.max_alloc =
        Some(u64::from(limits.max_width) * u64::from(limits.max_height) * 8 + (1 << 20));
    let mut r = image::ImageReader::with_format(std::io::Cursor::new(bytes), format);
    r.limits(decoder_limits);
    r.decode().map_err(|e| ImageError::Decode(e.to_string()))
}

/// `[3, S, S]` normalized pixel values of an `S×S` RGB image, channel-major.
fn normalize(rgb: &image::RgbImage, cfg: &VisionConfig) -> Vec<f32> {
    let n = rgb.width() as usize * rgb.height() as usize;
    let mut pixels = vec![0f32; 3 * n];
    for (i, p) in rgb.pixels().enumerate() {
        for c in 0..3 {
            pixels[c * n + i] = (f32::from(p.0[c]) / 255.0 - cfg.image_mean[c]) / cfg.image_std[c];
        }
    }
    pixels
}

/// Reads an image's header and says what it becomes for a tower of `cfg` ([`ImagePlan`]),
/// decoding no pixel.
///
/// # Errors
/// As [`prepare_image`], less a failure only decoding the pixels finds.
pub fn plan_image(
    bytes: &[u8],
    cfg: &VisionConfig,
    limits: &ImageLimits,
) -> std::result::Result<ImagePlan, ImageError> {
    let (_, width, height) = check_header(bytes, limits)?;
    Ok(plan_of(bytes, cfg, width, height))
}

fn plan_of(bytes: &[u8], cfg: &VisionConfig, width: u32, height: u32) -> ImagePlan {
    let digest = ImageDigest::of(&cfg.preprocessing_key(), bytes);
    let (grid, parts) = match &cfg.splitting {
        Some(split) => {
            let grid = split.grid(width, height);
            let n = grid.sub_images();
            let parts = if n == 1 {
                vec![digest]
            } else {
                let key = split.key();
                (0..n).map(|i| digest.part(i, n, &key)).collect()
            };
            (grid, parts)
        }
        None => (TileGrid::WHOLE, vec![digest]),
    };
    ImagePlan {
        digest,
        original_size: (width, height),
        grid,
        parts,
    }
}

/// Decodes, checks and normalizes an image (PNG or JPEG) for a tower of `cfg` as one global
/// image (the tower's whole input without splitting; with splitting see
/// [`prepare_image_parts`]).
///
/// # Errors
/// [`ImageError`] for too many bytes, an unsupported format, dimensions over `limits`, or
/// bytes that do not decode. Nothing is allocated for the pixels before the header's
/// dimensions passed the limits (and the decoder is held to them too).
pub fn prepare_image(
    bytes: &[u8],
    cfg: &VisionConfig,
    limits: &ImageLimits,
) -> std::result::Result<PreparedImage, ImageError> {
    let (format, width, height) = check_header(bytes, limits)?;
    let img = decode_checked(bytes, format, limits)?;
    let s = cfg.image_size as u32;
    let rgb = img
        .resize_exact(s, s, image::imageops::FilterType::Triangle)
        .to_rgb8();
    Ok(PreparedImage {
        digest: ImageDigest::of(&cfg.preprocessing_key(), bytes),
        original_size: (width, height),
        pixels: normalize(&rgb, cfg),
    })
}

/// Decodes, checks and prepares an image for a tower of `cfg`: its plan and its sub-images in
/// order (without splitting, the one global image of [`prepare_image`]; with it, the tiles
/// row-major, then the global image, as the module docs say).
///
/// # Errors
/// As [`prepare_image`].
pub fn prepare_image_parts(
    bytes: &[u8],
    cfg: &VisionConfig,
    limits: &ImageLimits,
) -> std::result::Result<(ImagePlan, Vec<PreparedImage>), ImageError> {
    let Some(split) = &cfg.splitting else {
        let one = prepare_image(bytes, cfg, limits)?;
        let plan = plan_of(bytes, cfg, one.original_size.0, one.original_size.1);
        return Ok((plan, vec![one]));
    };
    use image::imageops::{self, FilterType};
    let (format, width, height) = check_header(bytes, limits)?;
    let plan = plan_of(bytes, cfg, width, height);
    let rgb = decode_checked(bytes, format, limits)?.to_rgb8();
    let resize = |img: &image::RgbImage, (w, h): (u32, u32)| {
        if img.dimensions() == (w, h) {
            img.clone()
        } else {
            imageops::resize(img, w, h, FilterType::Lanczos3)
        }
    };
    let first = resize(&rgb, split.resized_size(width, height));
    drop(rgb);
    let second = resize(&first, split.tiled_size(first.width(), first.height()));
    drop(first);
    let t = split.tile_size as u32;
    let mut frames = Vec::with_capacity(plan.parts.len());
    for r in 0..plan.grid.rows as u32 {
        for c in 0..plan.grid.cols as u32 {
            frames.push(imageops::crop_imm(&second, c * t, r * t, t, t).to_image());
        }
    }
    frames.push(resize(&second, (t, t)));
    let parts = frames
        .iter()
        .zip(&plan.parts)
        .map(|(frame, digest)| PreparedImage {
            digest: *digest,
            original_size: (width, height),
            pixels: normalize(frame, cfg),
        })
        .collect();
    Ok((plan, parts))
}

/// One image's rows of decoder input embeddings.
#[derive(Debug)]
pub struct ImageEmbeds {
    /// The image's identity.
    pub digest: ImageDigest,
    /// Rows (= [`VisionConfig::tokens_per_image`]).
    pub rows: usize,
    /// Width of a row (the decoder's hidden size).
    pub width: usize,
    /// `[rows, width]` row-major.
    pub data: Vec<f32>,
}

impl ImageEmbeds {
    /// Row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.width..(i + 1) * self.width]
    }
}

struct EncoderLayer {
    ln1: (Tensor, Tensor),
    q: (Tensor, Tensor),
    k: (Tensor, Tensor),
    v: (Tensor, Tensor),
    out: (Tensor, Tensor),
    ln2: (Tensor, Tensor),
    fc1: (Tensor, Tensor),
    fc2: (Tensor, Tensor),
}

/// A SigLIP vision transformer with the Idefics3 connector (see the module docs), in f32 on
/// the CPU.
pub struct VisionTower {
    cfg: VisionConfig,
    patch: (Tensor, Tensor),
    pos: Tensor,
    layers: Vec<EncoderLayer>,
    post_ln: (Tensor, Tensor),
    proj: Tensor,
}

impl std::fmt::Debug for VisionTower {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VisionTower")
            .field("config", &self.cfg)
            .finish_non_exhaustive()
    }
}

/// `x · wᵀ + b` for `x: [n, in]`, `w: [out, in]`, `b: [out]`.
fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let y = x.matmul(&w.t()?)?;
    Ok(match b {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    })
}

fn layer_norm(x: &Tensor, (w, b): &(Tensor, Tensor), eps: f32) -> Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let y = xc.broadcast_div(&(var + f64::from(eps))?.sqrt()?)?;
    Ok(y.broadcast_mul(w)?.broadcast_add(b)?)
}

impl VisionTower {
    /// Builds the tower from `store` (the names of the module docs), checking every shape.
    ///
    /// # Errors
    /// [`ModelError::MissingTensor`], [`ModelError::BadShape`], a bad `cfg`.
    pub fn from_store(cfg: &VisionConfig, store: &TensorStore) -> Result<Self> {
        cfg.validate()?;
        let (h, p, f) = (cfg.hidden_size, cfg.patch_size, cfg.intermediate_size);
        let get = |name: &str, shape: &[usize]| -> Result<Tensor> {
            Ok(store
                .get_shaped(name, shape)?
                .dequantize(&Device::Cpu)?
                .to_dtype(DType::F32)?)
        };
        let wb = |name: &str, out: usize, inp: usize| -> Result<(Tensor, Tensor)> {
            Ok((
                get(&format!("{name}.weight"), &[out, inp])?,
                get(&format!("{name}.bias"), &[out])?,
            ))
        };
        let norm = |name: &str| -> Result<(Tensor, Tensor)> {
            Ok((
                get(&format!("{name}.weight"), &[h])?,
                get(&format!("{name}.bias"), &[h])?,
            ))
        };
        let patch_w = get("v.patch_embd.weight", &[h, 3, p, p])?.reshape((h, 3 * p * p))?;
        let patch_b = get("v.patch_embd.bias", &[h])?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let n = |s: &str| format!("v.blk.{i}.{s}");
            layers.push(EncoderLayer {
                ln1: norm(&n("ln1"))?,
                q: wb(&n("attn_q"), h, h)?,
                k: wb(&n("attn_k"), h, h)?,
                v: wb(&n("attn_v"), h, h)?,
                out: wb(&n("attn_out"), h, h)?,
                ln2: norm(&n("ln2"))?,
                fc1: wb(&n("ffn_up"), f, h)?,
                fc2: wb(&n("ffn_down"), h, f)?,
            });
        }
        let r2 = cfg.scale_factor * cfg.scale_factor;
        Ok(Self {
            cfg: cfg.clone(),
            patch: (patch_w, patch_b),
            pos: get("v.position_embd.weight", &[cfg.num_patches(), h])?,
            layers,
            post_ln: norm("v.post_ln")?,
            proj: get("mm.model.fc.weight", &[cfg.text_hidden_size, h * r2])?,
        })
    }

    /// The tower's configuration.
    pub fn config(&self) -> &VisionConfig {
        &self.cfg
    }

    /// Encodes one prepared image into [`VisionConfig::tokens_per_image`] rows of the
    /// decoder's hidden size.
    ///
    /// # Errors
    /// A pixel buffer of the wrong size ([`ModelError::InvalidBatch`]); tensor-library
    /// failures.
    pub fn encode(&self, image: &PreparedImage) -> Result<ImageEmbeds> {
        let c = &self.cfg;
        let (s, p, g, h) = (
            c.image_size,
            c.patch_size,
            c.patches_per_side(),
            c.hidden_size,
        );
        if image.pixels.len() != 3 * s * s {
            return Err(ModelError::InvalidBatch(format!(
                "image of {} values, the tower takes 3x{s}x{s}",
                image.pixels.len()
            )));
        }
        // Patches in raster order, each flattened as [channel, row, column] (the conv
        // weight's order): [3, g, P, g, P] → [g, g, 3, P, P].
        let px = Tensor::from_slice(&image.pixels, (3, g, p, g, p), &Device::Cpu)?
            .permute((1, 3, 0, 2, 4))?
            .contiguous()?
            .reshape((g * g, 3 * p * p))?;
        let mut x = linear(&px, &self.patch.0, Some(&self.patch.1))?.broadcast_add(&self.pos)?;
        let (nh, hd) = (c.num_heads, h / c.num_heads);
        let n = g * g;
        let scale = 1.0 / (hd as f64).sqrt();
        for l in &self.layers {
            let y = layer_norm(&x, &l.ln1, c.layer_norm_eps)?;
            let heads = |w: &(Tensor, Tensor)| -> Result<Tensor> {
                Ok(linear(&y, &w.0, Some(&w.1))?
                    .reshape((n, nh, hd))?
                    .transpose(0, 1)?
                    .contiguous()?)
            };
            let (q, k, v) = (heads(&l.q)?, heads(&l.k)?, heads(&l.v)?);
            let scores = (q.matmul(&k.t()?)? * scale)?;
            let max = scores.max_keepdim(D::Minus1)?;
            let e = scores.broadcast_sub(&max)?.exp()?;
            let probs = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
            let attn = probs
                .matmul(&v)?
                .transpose(0, 1)?
                .contiguous()?
                .reshape((n, h))?;
            x = (x + linear(&attn, &l.out.0, Some(&l.out.1))?)?;
            let y = layer_norm(&x, &l.ln2, c.layer_norm_eps)?;
            let m = linear(&y, &l.fc1.0, Some(&l.fc1.1))?.gelu()?;
            x = (x + linear(&m, &l.fc2.0, Some(&l.fc2.1))?)?;
        }
        let x = layer_norm(&x, &self.post_ln, c.layer_norm_eps)?;
        // Idefics3Connector.pixel_shuffle (batch of one).
        let r = c.scale_factor;
        let x = x
            .reshape((g, g / r, h * r))?
            .transpose(0, 1)?
            .contiguous()?
            .reshape((g / r, g / r, h * r * r))?
            .transpose(0, 1)?
            .contiguous()?
            .reshape((n / (r * r), h * r * r))?;
        let out = linear(&x, &self.proj, None)?;
        let rows = n / (r * r);
        Ok(ImageEmbeds {
            digest: image.digest,
            rows,
            width: c.text_hidden_size,
            data: out.flatten_all()?.to_vec1::<f32>()?,
        })
    }
}

/// A vision tower ready to serve: shared by whoever encodes images.
pub type SharedVisionTower = Arc<VisionTower>;

#[cfg(test)]
mod tests {
    use super::*;

    fn png(w: u32, h: u32, seed: u8) -> Vec<u8> {
        let img = image::RgbImage::from_fn(w, h, |x, y| {
            image::Rgb([
                (x as u8).wrapping_mul(seed),
                (y as u8).wrapping_add(seed),
                seed,
            ])
        });
        let mut out = std::io::Cursor::new(Vec::new());
        img.write_to(&mut out, image::ImageFormat::Png).unwrap();
        out.into_inner()
    }

    fn cfg() -> VisionConfig {
        crate::synthetic::SyntheticSpec::parse("tiny,vision=1")
            .unwrap()
            .vision
            .unwrap()
    }

    #[test]
    fn images_are_checked_before_they_are_decoded() {
        let c = cfg();
        let lim = ImageLimits {
            max_bytes: 1 << 20,
            max_width: 64,
            max_height: 64,
        };
        let ok = prepare_image(&png(40, 20, 3), &c, &lim).unwrap();
        assert_eq!(ok.pixels.len(), 3 * c.image_size * c.image_size);
        assert_eq!(ok.original_size, (40, 20));
        // Normalized into [-1, 1] by mean 0.5, std 0.5.
        assert!(ok.pixels.iter().all(|v| (-1.0..=1.0).contains(v)));
        assert_eq!(
            prepare_image(&png(65, 10, 3), &c, &lim).unwrap_err().kind(),
            "image_too_large"
        );
        let small = ImageLimits {
            max_bytes: 10,
            ..lim
        };
        assert_eq!(
            prepare_image(&png(8, 8, 3), &c, &small).unwrap_err().kind(),
            "image_too_many_bytes"
        );
        assert_eq!(
            prepare_image(b"GIF89a......", &c, &lim).unwrap_err().kind(),
            "image_unsupported"
        );
        assert_eq!(
            prepare_image(b"not an image at all", &c, &lim)
                .unwrap_err()
                .kind(),
            "image_unsupported"
        );
        let mut cut = png(16, 16, 3);
        cut.truncate(cut.len() / 2);
        assert_eq!(
            prepare_image(&cut, &c, &lim).unwrap_err().kind(),
            "image_decode"
        );
    }

    #[test]
    fn digest_covers_bytes_and_settings() {
        let c = cfg();
        let a = ImageDigest::of(&c.preprocessing_key(), b"abc");
        assert_eq!(a, ImageDigest::of(&c.preprocessing_key(), b"abc"));
        assert_ne!(a, ImageDigest::of(&c.preprocessing_key(), b"abd"));
        let other = VisionConfig {
            image_size: c.image_size * 2,
            ..c.clone()
        };
        assert_ne!(a, ImageDigest::of(&other.preprocessing_key(), b"abc"));
    }

    #[test]
    fn pixel_shuffle_groups_neighbouring_patches() {
        // A 4x4 grid of 1-wide features, r = 2: output row 0 holds patches (0,0), (0,1),
        // (1,0), (1,1) — HF's order: [row0: col0, col1][row1: col0, col1].
        let (g, r, h) = (4usize, 2usize, 1usize);
        let x =
            Tensor::from_vec((0..16).map(|i| i as f32).collect(), (16, 1), &Device::Cpu).unwrap();
        let y = x
            .reshape((g, g / r, h * r))
            .unwrap()
            .transpose(0, 1)
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape((g / r, g / r, h * r * r))
            .unwrap()
            .transpose(0, 1)
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape((4, 4))
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        assert_eq!(y[0], vec![0.0, 1.0, 4.0, 5.0]);
        assert_eq!(y[1], vec![2.0, 3.0, 6.0, 7.0]);
        assert_eq!(y[2], vec![8.0, 9.0, 12.0, 13.0]);
    }

    #[test]
    fn splitting_is_bounded_by_its_settings() {
        let s = |longest_edge, tile_size| ImageSplitting {
            longest_edge,
            tile_size,
        };
        // SmolVLM-256M and SmolVLM-Instruct: up to 4x4 tiles and the global image.
        assert_eq!(s(2048, 512).max_grid_side(), 4);
        assert_eq!(s(1536, 384).max_grid_side(), 4);
        // An odd longest edge may round the short side up past it.
        assert_eq!(s(1025, 512).max_grid_side(), 3);
        // An edge that fits one tile never cuts an image.
        assert_eq!(s(512, 512).max_grid_side(), 0);
        assert_eq!(s(512, 512).grid(4000, 10), TileGrid::WHOLE);
        // Every image size stays within the bound.
        for (w, h) in [
            (1, 1),
            (1, 4096),
            (4096, 1),
            (4096, 4095),
            (333, 333),
            (2, 3),
        ] {
            for split in [s(2048, 512), s(1025, 512), s(64, 32), s(3584, 512)] {
                let g = split.grid(w, h);
                let side = split.max_grid_side();
                assert!(g.rows <= side && g.cols <= side, "{split:?} {w}x{h}: {g:?}");
            }
        }
        // 7x7 tiles and the global image fit 64 sub-images; 8x8 do not.
        assert!(s(3584, 512).validate(512).is_ok());
        let e = s(4096, 512).validate(512).unwrap_err();
        assert!(e.to_string().contains("64 sub-images"), "{e}");
        assert!(s(4097, 4097).validate(4097).is_err());
        assert!(s(2048, 512).validate(384).is_err());
        // A config with splitting and no wrapper tokens is refused.
        let c = VisionConfig {
            splitting: Some(s(64, 32)),
            wrap: None,
            ..cfg()
        };
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("<global-img>"));
        // Each sub-image has its own digest, tied to the settings.
        let d = ImageDigest([7; 32]);
        let k = s(64, 32).key();
        assert_ne!(d.part(0, 5, &k), d.part(1, 5, &k));
        assert_ne!(d.part(0, 5, &k), d.part(0, 3, &k));
        assert_ne!(d.part(0, 5, &k), d.part(0, 5, &s(128, 32).key()));
        assert_ne!(c.preprocessing_key(), cfg().preprocessing_key());
    }
}
