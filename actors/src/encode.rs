//! Encoder disaggregation (E/P/D): image encoders as their own instances.
//!
//! An **encode instance** (`instance.role = "encode"`) runs a vision-language model's vision
//! tower and nothing else a client sees: `POST /v1/encode` takes a chat request, encodes its
//! images (or finds them in its encoder cache, keyed by each image's digest) and keeps them
//! there. The instance that computes the prompt — a prefill instance, a colocated one, or a
//! decode instance that may prefill a short suffix itself — gets the request with
//! `ec_transfer_params: {"encoder_url": ...}` and takes the embeddings it lacks from that
//! encoder over the transfer engine ([`client::EncoderClient`]), with the KV hand-off's
//! rules: a handshake that checks model, preprocessing, row shape and backend; a keyed read
//! session; a hold of the images under a lease, in a read scope fenced by the hold's id; a
//! release that says whether the lease held ([`protocol`], [`service::EncoderService`]).
//!
//! A decode instance that drives its prefill instance passes the images on in the peer
//! protocol as references (position, digest, rows) with the encoder's URL
//! ([`crate::handoff::protocol::PrefillWithImages`]); the prefill instance takes the
//! embeddings from the encoder the same way. See `docs/multimodal.md`.

pub mod actor;
pub mod client;
pub mod protocol;
pub mod service;

pub use actor::{VisionEncoder, VisionEncoderArgs, VisionEncoderHandle};
pub use client::{EncoderClient, Expect};
pub use protocol::EncoderError;
pub use service::{EncoderService, EncoderSettings};

use crate::handoff::protocol::ImageRef;
use crate::handoff::HandoffError;
use crate::multimodal::EncoderCache;
use crate::scheduler::PromptImage;
use pdserve_gpu::vision::{ImageDigest, ImageEmbeds};
use std::sync::Arc;

/// How an instance of a vision-language model gets image embeddings it did not encode: its
/// encoder cache first, then the encode instance named by the request.
pub struct ImageResolver {
    /// Reads from encode instances.
    pub client: EncoderClient,
    /// This instance's encoder cache (what was fetched is kept there too).
    pub cache: Arc<EncoderCache>,
    /// The placeholder token an image's rows take in the prompt.
    pub image_token: u32,
    /// Rows of one image.
    pub rows: usize,
}

impl ImageResolver {
    /// The embeddings of `digests`, in order: from the cache where held, the rest from the
    /// encode instance at `encoder_url` (and kept in the cache).
    ///
    /// # Errors
    /// The fetch's failure.
    pub async fn resolve(
        &self,
        encoder_url: &str,
        digests: &[ImageDigest],
    ) -> Result<Vec<Arc<ImageEmbeds>>, EncoderError> {
        let mut out: Vec<Option<Arc<ImageEmbeds>>> =
            digests.iter().map(|d| self.cache.get(d)).collect();
        let missing: Vec<ImageDigest> = digests
            .iter()
            .zip(&out)
            .filter(|(_, e)| e.is_none())
            .map(|(d, _)| *d)
            .collect();
        for e in &out {
            let result = if e.is_some() { "hit" } else { "miss" };
            metrics::counter!(crate::multimodal::ENCODER_CACHE_LOOKUPS_TOTAL, "result" => result)
                .increment(1);
        }
        if !missing.is_empty() {
            let fetched = self.client.fetch(encoder_url, &missing).await?;
            let mut fetched = fetched.into_iter().map(Arc::new);
            for slot in out.iter_mut().filter(|e| e.is_none()) {
                let e = fetched.next().expect("one per missing digest");
                self.cache.insert(e.clone());
                *slot = Some(e);
            }
        }
        Ok(out.into_iter().map(|e| e.expect("filled")).collect())
    }

    /// A peer's image references checked against `prompt`: in order, inside it, not
    /// overlapping, of our row count, each over our placeholder token.
    ///
    /// # Errors
    /// [`HandoffError::BadRequest`] naming the first bad reference.
    pub fn check_refs(&self, prompt: &[u32], refs: &[ImageRef]) -> Result<(), HandoffError> {
        check_image_refs(prompt, refs, self.rows, self.image_token)
    }

    /// The prompt's images for the Scheduler, from checked `refs` and their embeddings.
    pub fn place(refs: &[ImageRef], embeds: Vec<Arc<ImageEmbeds>>) -> Vec<PromptImage> {
        refs.iter()
            .zip(embeds)
            .map(|(r, embeds)| PromptImage {
                at: r.at as usize,
                embeds,
            })
            .collect()
    }
}

/// [`ImageResolver::check_refs`] for a model whose images are `rows` positions of `image_token`.
fn check_image_refs(
    prompt: &[u32],
    refs: &[ImageRef],
    rows_per_image: usize,
    image_token: u32,
) -> Result<(), HandoffError> {
    let mut next_free = 0usize;
    for (i, r) in refs.iter().enumerate() {
        let (at, rows) = (r.at as usize, r.rows as usize);
        if rows != rows_per_image {
            return Err(HandoffError::BadRequest(format!(
                "image {i} has {rows} rows, this model's images {}",
                rows_per_image
            )));
        }
        let end = at.checked_add(rows).filter(|&e| e <= prompt.len());
        let Some(end) = end.filter(|_| at >= next_free) else {
            return Err(HandoffError::BadRequest(format!(
                "image {i} at {at}..+{rows} is out of order or outside the prompt of {} tokens",
                prompt.len()
            )));
        };
        if prompt[at..end].iter().any(|&t| t != image_token) {
            return Err(HandoffError::BadRequest(format!(
                "image {i}'s positions {at}..{end} do not all hold the image placeholder token {}",
                image_token
            )));
        }
        next_free = end;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(at: u32, rows: u32) -> ImageRef {
        ImageRef {
            at,
            digest: [0; 32],
            rows,
        }
    }

    #[test]
    fn hostile_image_references_are_refused_by_name() {
        // 2 text tokens, an image of 3 rows (token 9), 1 text token, another image.
        let prompt = [1, 2, 9, 9, 9, 4, 9, 9, 9];
        let check = |refs: &[ImageRef]| check_image_refs(&prompt, refs, 3, 9);
        assert!(check(&[r(2, 3), r(6, 3)]).is_ok());
        let msg = |refs: &[ImageRef]| check(refs).unwrap_err().to_string();
        assert!(msg(&[r(2, 4)]).contains("4 rows"));
        assert!(msg(&[r(7, 3)]).contains("outside the prompt"));
        assert!(msg(&[r(u32::MAX, 3)]).contains("outside the prompt"));
        assert!(msg(&[r(6, 3), r(2, 3)]).contains("out of order"));
        assert!(msg(&[r(2, 3), r(4, 3)]).contains("out of order"));
        assert!(msg(&[r(1, 3)]).contains("placeholder token 9"));
    }
}
