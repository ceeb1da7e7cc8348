//! The shape of a Llama-family decoder, read from GGUF metadata or an HF `config.json`.

use crate::{ModelError, Result};
use serde::{Deserialize, Serialize};

/// How rotary embeddings pair up the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RopeStyle {
    /// Pairs `(2i, 2i+1)`: llama.cpp's "normal" rope, used by GGUF `llama` models (whose Q/K
    /// weights were permuted at conversion).
    Interleaved,
    /// Pairs `(i, i + d/2)`: NeoX style, used by HF safetensors checkpoints and GGUF `qwen2`.
    Half,
}

/// A RoPE frequency scaling variant.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor` (a.k.a. position interpolation).
    Linear {
        /// Scaling factor.
        factor: f32,
    },
    /// Llama 3.1's wavelength-dependent scaling.
    Llama3 {
        /// Scaling factor.
        factor: f32,
        /// Low frequency factor.
        low_freq_factor: f32,
        /// High frequency factor.
        high_freq_factor: f32,
        /// Context the model was pre-trained with.
        original_max_position: usize,
    },
}

/// Architecture hyper-parameters of a Llama-family model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Architecture name as the file states it (`llama`, `qwen2`, ...).
    pub architecture: String,
    /// Vocabulary size (rows of the embedding and the output layer).
    pub vocab_size: usize,
    /// Hidden (embedding) size.
    pub hidden_size: usize,
    /// Number of decoder layers.
    pub num_layers: usize,
    /// Attention (query) heads.
    pub num_heads: usize,
    /// Key/value heads (GQA when fewer than `num_heads`).
    pub num_kv_heads: usize,
    /// Size of one head.
    pub head_dim: usize,
    /// Intermediate size of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// RoPE base frequency.
    pub rope_theta: f32,
    /// RoPE scaling variant.
    pub rope_scaling: RopeScaling,
    /// RoPE pairing style.
    pub rope_style: RopeStyle,
    /// Maximum context length in tokens.
    pub context_length: usize,
    /// Whether Q/K/V projections carry a bias (Qwen2).
    pub qkv_bias: bool,
    /// Per-dimension divisors of the RoPE frequencies, as Llama 3.1 GGUF files store them
    /// (`rope_freqs.weight`); applied on top of `rope_scaling`.
    #[serde(default)]
    pub rope_freq_factors: Option<Vec<f32>>,
}

impl ModelConfig {
    /// Checks the shape is self-consistent.
    ///
    /// # Errors
    /// [`ModelError::BadMetadata`] naming the first inconsistent field.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str| Err(ModelError::BadMetadata(what.to_string()));
        if self.num_layers == 0 {
            return bad("num_layers must be > 0");
        }
        if self.num_heads == 0 || self.num_kv_heads == 0 {
            return bad("head counts must be > 0");
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad("num_heads must be a multiple of num_kv_heads");
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad("head_dim must be even and > 0");
        }
        if self.vocab_size == 0 || self.hidden_size == 0 || self.intermediate_size == 0 {
            return bad("vocab, hidden and intermediate sizes must be > 0");
        }
        if self.context_length == 0 {
            return bad("context_length must be > 0");
        }
        // Floats from a file: a NaN, infinite or non-positive one would poison every step.
        let positive = |x: f32| x.is_finite() && x > 0.0;
        if !positive(self.rms_norm_eps) {
            return bad(&format!(
                "rms_norm_eps = {} must be finite and > 0",
                self.rms_norm_eps
            ));
        }
        if !positive(self.rope_theta) {
            return bad(&format!(
                "rope_theta = {} must be finite and > 0",
                self.rope_theta
            ));
        }
        let factors: &[f32] = match &self.rope_scaling {
            RopeScaling::None => &[],
            RopeScaling::Linear { factor } => &[*factor],
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => {
                if *original_max_position == 0 {
                    return bad("rope scaling original_max_position must be > 0");
                }
                &[*factor, *low_freq_factor, *high_freq_factor]
            }
        };
        if let Some(f) = factors.iter().find(|&&f| !positive(f)) {
            return bad(&format!("rope scaling factor {f} must be finite and > 0"));
        }
        Ok(())
    }

    /// Checks that `tp` ranks can split this model by heads, MLP columns and vocabulary.
    ///
    /// # Errors
    /// [`ModelError::BadTpSize`] naming the dimension `tp` does not divide.
    pub fn check_tp(&self, tp: usize) -> Result<()> {
        if tp == 0 {
            return Err(ModelError::BadTpSize {
                tp,
                what: "anything (tp must be ≥ 1)",
                count: 0,
            });
        }
        let dims: [(&'static str, usize); 4] = [
            ("the KV head count", self.num_kv_heads),
            ("the attention head count", self.num_heads),
            ("the MLP intermediate size", self.intermediate_size),
            ("the vocabulary size", self.vocab_size),
        ];
        for (what, count) in dims {
            if !count.is_multiple_of(tp) {
                return Err(ModelError::BadTpSize { tp, what, count });
            }
        }
        Ok(())
    }

    /// Number of query heads per KV head.
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// Per-dimension inverse frequencies of RoPE, with scaling applied.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let half = self.head_dim / 2;
        let base: Vec<f32> = (0..half)
            .map(|i| 1.0 / self.rope_theta.powf(2.0 * i as f32 / self.head_dim as f32))
            .collect();
        let base = match &self.rope_freq_factors {
            Some(f) => base.iter().zip(f).map(|(b, f)| b / f).collect(),
            None => base,
        };
        match self.rope_scaling {
            RopeScaling::None | RopeScaling::Linear { .. } => base,
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => {
                let old = original_max_position as f32;
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                base.into_iter()
                    .map(|f| {
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        }
    }

    /// Position multiplier of linear scaling (1 otherwise).
    pub fn rope_position_scale(&self) -> f32 {
        match self.rope_scaling {
            RopeScaling::Linear { factor } => 1.0 / factor,
            _ => 1.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ModelConfig {
        ModelConfig {
            architecture: "llama".into(),
            vocab_size: 49152,
            hidden_size: 576,
            num_layers: 30,
            num_heads: 9,
            num_kv_heads: 3,
            head_dim: 64,
            intermediate_size: 1536,
            rms_norm_eps: 1e-5,
            rope_theta: 100_000.0,
            rope_scaling: RopeScaling::None,
            rope_style: RopeStyle::Interleaved,
            context_length: 8192,
            qkv_bias: false,
            rope_freq_factors: None,
        }
    }

    #[test]
    fn tp_must_divide_kv_heads() {
        let c = cfg();
        c.check_tp(1).unwrap();
        c.check_tp(3).unwrap();
        let err = c.check_tp(2).unwrap_err();
        assert!(
            matches!(
                err,
                ModelError::BadTpSize {
                    tp: 2,
                    count: 3,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("KV head"), "{err}");
    }

    #[test]
    fn llama3_scaling_keeps_high_freqs_and_divides_low_ones() {
        let mut c = cfg();
        c.head_dim = 128;
        c.rope_theta = 500_000.0;
        let plain = c.rope_inv_freq();
        c.rope_scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192,
        };
        let scaled = c.rope_inv_freq();
        assert_eq!(plain[0], scaled[0]);
        let last = plain.len() - 1;
        assert!((scaled[last] - plain[last] / 8.0).abs() < 1e-12);
    }
}
