//! Fault injection for tests and drills: the `[faults]` config section and the seeded
//! [`FaultInjector`] the actors consult at their fault points.
//!
//! Every fault goes through the code path a real fault would take, so the reliability suite
//! tests recovery, not the injector:
//! - **transfers** (KV reads and writes): a failed batch reports the engine error a dead link
//!   gives; a delayed batch starts late; a corrupted batch has one span pointed outside its
//!   region, which the transfer engine must refuse;
//! - **silent KV damage** (negative controls of the P/D identity tests, never a recovery
//!   drill): a transfer batch that skips one block, or fills one block's keys with that
//!   block's values, completes as if nothing happened — no layer of pdserve can see it, so the
//!   tokens decoded from that KV must differ from a colocated run's, which is what the tests
//!   that compare them prove they can catch;
//! - **control messages** (the instance-to-instance KV calls — remote prefill, lease renewal,
//!   release, abort — and control-plane heartbeats): a dropped message is never sent and its
//!   sender waits out its bound, as it would for a lost one; a delayed message goes out late; a
//!   corrupted message carries a body that does not parse, which the receiver must refuse;
//! - **memory registration** of a KV region fails (a worker cannot start; its supervisor
//!   retries under its restart budget);
//! - **KV tier spills**: the end of a spill (the ranks copied the blocks the pool evicted out
//!   for the tiers; only then may a KV transfer land in those blocks) is reported late, as a
//!   slow copy would be, so a hand-off whose destination blocks were evicted starts late;
//! - **KV tier restores streamed layer by layer**: the last layer lands only once a rank has
//!   taken an earlier one (or at the load's deadline), which shows compute starting before
//!   the load ends — a restore that waited for every layer would time out;
//! - **actor panics**: the actor named by `actor_panic_target` (`TpWorker` by default,
//!   or `Scheduler`, `KvSender`, `KvReceiver`, `Aggregator`, `HttpFrontend`) panics as it
//!   takes a message from its mailbox, at most `actor_panic_max` times; its supervisor
//!   handles it as any other failure (see `actors/src/supervisor.rs`).
//!
//! With every rate 0 (the default) nothing is injected and [`FaultInjector::new`] returns
//! `None`: production paths pay one `Option` check.

use crate::supervision::ActorKind;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// `[faults]`: test-only fault injection (see the module docs). Rates are probabilities per
/// event, in `[0, 1]`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FaultSection {
    /// KV transfer batches that fail.
    pub transfer_fail: f64,
    /// KV transfer batches that start `transfer_delay_ms` late.
    pub transfer_delay: f64,
    /// Delay of a delayed transfer batch.
    pub transfer_delay_ms: u64,
    /// KV transfer batches with a corrupted span (refused by the engine).
    pub transfer_corrupt: f64,
    /// KV transfer batches that silently leave out one block (the batch's first destination
    /// block, every layer it covers, K and V): the receiver keeps whatever that block held.
    pub transfer_skip_block: f64,
    /// KV transfer batches that silently deliver wrong bytes into one block (the batch's first
    /// destination block): its keys are written from the same block's values.
    pub transfer_garble_block: f64,
    /// Control messages never sent.
    pub control_drop: f64,
    /// Control messages sent `control_delay_ms` late.
    pub control_delay: f64,
    /// Delay of a delayed control message.
    pub control_delay_ms: u64,
    /// Control messages whose body is replaced by bytes that do not parse.
    pub control_corrupt: f64,
    /// KV memory registrations that fail.
    pub register_fail: f64,
    /// KV tier spills whose end is reported `spill_delay_ms` late.
    pub spill_delay: f64,
    /// Delay of a delayed spill's end.
    pub spill_delay_ms: u64,
    /// Streamed KV tier restores whose last layer lands only once a rank took an earlier
    /// one (bounded by `kv_tiers.load_timeout_ms`): shows compute starting before it.
    pub tier_stream_hold: f64,
    /// Messages at which the `actor_panic_target` actor panics (for a TpWorker: steps).
    #[serde(alias = "worker_panic")]
    pub actor_panic: f64,
    /// Most actor panics injected over the process's life.
    #[serde(alias = "worker_panic_max")]
    pub actor_panic_max: u64,
    /// Which actor kind panics: one of [`PANIC_TARGETS`] (default `TpWorker`).
    pub actor_panic_target: String,
    /// Seed of the fault generator (the same seed draws the same faults in the same order).
    pub seed: u64,
}

impl FaultSection {
    /// Whether any fault can be injected.
    pub fn is_active(&self) -> bool {
        self.rates().iter().any(|(_, r)| *r > 0.0)
    }

    fn rates(&self) -> [(&'static str, f64); 12] {
        [
            ("faults.transfer_fail", self.transfer_fail),
            ("faults.transfer_delay", self.transfer_delay),
            ("faults.transfer_corrupt", self.transfer_corrupt),
            ("faults.transfer_skip_block", self.transfer_skip_block),
            ("faults.transfer_garble_block", self.transfer_garble_block),
            ("faults.control_drop", self.control_drop),
            ("faults.control_delay", self.control_delay),
            ("faults.control_corrupt", self.control_corrupt),
            ("faults.register_fail", self.register_fail),
            ("faults.actor_panic", self.actor_panic),
            ("faults.spill_delay", self.spill_delay),
            ("faults.tier_stream_hold", self.tier_stream_hold),
        ]
    }

    /// The actor kind `actor_panic` applies to (`None`: a name that is not one of
    /// [`PANIC_TARGETS`], refused by [`FaultSection::invalid`]).
    pub fn panic_target(&self) -> Option<ActorKind> {
        if self.actor_panic_target.is_empty() {
            return Some(ActorKind::TpWorker);
        }
        self.actor_panic_target
            .parse()
            .ok()
            .filter(|k| PANIC_TARGETS.contains(k))
    }

    /// The first rate outside `[0, 1]`, as `(key, message)`.
    pub fn invalid(&self) -> Option<(&'static str, String)> {
        if self.panic_target().is_none() {
            return Some((
                "faults.actor_panic_target",
                format!(
                    "faults.actor_panic_target must be one of {}, got {:?}",
                    PANIC_TARGETS.map(ActorKind::as_str).join(", "),
                    self.actor_panic_target
                ),
            ));
        }
        self.rates()
            .into_iter()
            .find(|(_, r)| !(0.0..=1.0).contains(r))
            .map(|(k, r)| (k, format!("{k} must be a probability in [0, 1], got {r}")))
    }
}

/// One kind of injectable fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// A transfer batch fails.
    TransferFail,
    /// A transfer batch starts late.
    TransferDelay,
    /// A transfer batch is corrupted.
    TransferCorrupt,
    /// A control message is dropped.
    ControlDrop,
    /// A control message is late.
    ControlDelay,
    /// A control message is corrupted.
    ControlCorrupt,
    /// A memory registration fails.
    RegisterFail,
    /// An actor panics.
    ActorPanic,
    /// A transfer batch silently leaves out one block.
    TransferSkipBlock,
    /// A transfer batch silently delivers wrong bytes into one block.
    TransferGarbleBlock,
    /// A KV tier spill's end is reported late.
    SpillDelay,
    /// A streamed KV tier restore holds its last layer.
    TierStreamHold,
}

/// The actor kinds `faults.actor_panic_target` may name.
pub const PANIC_TARGETS: [ActorKind; 7] = ActorKind::SUPERVISED;

const KINDS: usize = 12;

impl Fault {
    fn index(self) -> usize {
        self as usize
    }

    /// A stable name (`transfer_fail`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::TransferFail => "transfer_fail",
            Self::TransferDelay => "transfer_delay",
            Self::TransferCorrupt => "transfer_corrupt",
            Self::ControlDrop => "control_drop",
            Self::ControlDelay => "control_delay",
            Self::ControlCorrupt => "control_corrupt",
            Self::RegisterFail => "register_fail",
            Self::ActorPanic => "actor_panic",
            Self::TransferSkipBlock => "transfer_skip_block",
            Self::TransferGarbleBlock => "transfer_garble_block",
            Self::SpillDelay => "spill_delay",
            Self::TierStreamHold => "tier_stream_hold",
        }
    }
}

/// What a control message's sender does with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlFault {
    /// Send it as it is.
    Send,
    /// Do not send it.
    Drop,
    /// Send it after this long.
    Delay(Duration),
    /// Send a body that does not parse instead.
    Corrupt,
}

/// What a transfer batch's submitter does with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferFault {
    /// Submit it as it is.
    Submit,
    /// Fail it without submitting.
    Fail,
    /// Submit it after this long.
    Delay(Duration),
    /// Corrupt one span, then submit.
    Corrupt,
    /// Leave out one block's spans, then submit (nothing notices).
    SkipBlock,
    /// Point one block's key spans at its value spans, then submit (nothing notices).
    GarbleBlock,
}

/// Draws faults from a [`FaultSection`] with a seeded generator, and counts what it injected.
#[derive(Debug)]
pub struct FaultInjector {
    cfg: FaultSection,
    state: Mutex<u64>,
    injected: [AtomicU64; KINDS],
}

impl FaultInjector {
    /// An injector, or `None` when nothing would ever be injected.
    pub fn new(cfg: &FaultSection) -> Option<Arc<Self>> {
        cfg.is_active().then(|| {
            Arc::new(Self {
                cfg: cfg.clone(),
                state: Mutex::new(cfg.seed ^ 0x5851_f42d_4c95_7f2d),
                injected: Default::default(),
            })
        })
    }

    /// A uniform draw in `[0, 1)` (splitmix64).
    fn draw(&self) -> f64 {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        *s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    fn rate(&self, f: Fault) -> f64 {
        let c = &self.cfg;
        match f {
            Fault::TransferFail => c.transfer_fail,
            Fault::TransferDelay => c.transfer_delay,
            Fault::TransferCorrupt => c.transfer_corrupt,
            Fault::ControlDrop => c.control_drop,
            Fault::ControlDelay => c.control_delay,
            Fault::ControlCorrupt => c.control_corrupt,
            Fault::RegisterFail => c.register_fail,
            Fault::ActorPanic => c.actor_panic,
            Fault::TransferSkipBlock => c.transfer_skip_block,
            Fault::TransferGarbleBlock => c.transfer_garble_block,
            Fault::SpillDelay => c.spill_delay,
            Fault::TierStreamHold => c.tier_stream_hold,
        }
    }

    /// Whether to inject `fault` now (counted when it is).
    pub fn roll(&self, fault: Fault) -> bool {
        let rate = self.rate(fault);
        if rate <= 0.0 || self.draw() >= rate {
            return false;
        }
        if fault == Fault::ActorPanic {
            let n = &self.injected[fault.index()];
            let cap = self.cfg.actor_panic_max;
            if n.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| {
                (v < cap).then_some(v + 1)
            })
            .is_err()
            {
                return false;
            }
        } else {
            self.injected[fault.index()].fetch_add(1, Ordering::Relaxed);
        }
        tracing::info!(fault = fault.as_str(), "injecting a fault");
        true
    }

    /// Whether an actor of `kind` panics at the message it is taking now.
    pub fn actor_panics(&self, kind: ActorKind) -> bool {
        self.cfg.panic_target() == Some(kind) && self.roll(Fault::ActorPanic)
    }

    /// The fate of one control message.
    pub fn control(&self) -> ControlFault {
        if self.roll(Fault::ControlDrop) {
            ControlFault::Drop
        } else if self.roll(Fault::ControlCorrupt) {
            ControlFault::Corrupt
        } else if self.roll(Fault::ControlDelay) {
            ControlFault::Delay(Duration::from_millis(self.cfg.control_delay_ms))
        } else {
            ControlFault::Send
        }
    }

    /// The fate of one transfer batch.
    pub fn transfer(&self) -> TransferFault {
        if self.roll(Fault::TransferFail) {
            TransferFault::Fail
        } else if self.roll(Fault::TransferCorrupt) {
            TransferFault::Corrupt
        } else if self.roll(Fault::TransferSkipBlock) {
            TransferFault::SkipBlock
        } else if self.roll(Fault::TransferGarbleBlock) {
            TransferFault::GarbleBlock
        } else if self.roll(Fault::TransferDelay) {
            TransferFault::Delay(Duration::from_millis(self.cfg.transfer_delay_ms))
        } else {
            TransferFault::Submit
        }
    }

    /// How late to report the end of one KV tier spill (`None`: on time).
    pub fn spill(&self) -> Option<Duration> {
        self.roll(Fault::SpillDelay)
            .then(|| Duration::from_millis(self.cfg.spill_delay_ms))
    }

    /// Whether a streamed KV tier restore holds its last layer until a rank took another.
    pub fn tier_stream_hold(&self) -> bool {
        self.roll(Fault::TierStreamHold)
    }

    /// How many faults of `kind` were injected.
    pub fn injected(&self, kind: Fault) -> u64 {
        self.injected[kind.index()].load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_injected_by_default_and_rates_are_checked() {
        assert!(FaultInjector::new(&FaultSection::default()).is_none());
        let bad = FaultSection {
            transfer_fail: 1.5,
            ..Default::default()
        };
        assert_eq!(bad.invalid().unwrap().0, "faults.transfer_fail");
        let bad = FaultSection {
            actor_panic_target: "Proxy".into(),
            ..Default::default()
        };
        let (key, msg) = bad.invalid().unwrap();
        assert_eq!(key, "faults.actor_panic_target");
        assert!(
            msg.contains("KvSender") && msg.contains("\"Proxy\""),
            "{msg}"
        );
    }

    #[test]
    fn rates_are_honoured_deterministically_and_panics_are_capped() {
        let cfg = FaultSection {
            transfer_fail: 0.25,
            actor_panic: 1.0,
            actor_panic_max: 2,
            actor_panic_target: "KvSender".into(),
            seed: 9,
            ..Default::default()
        };
        let a = FaultInjector::new(&cfg).unwrap();
        let b = FaultInjector::new(&cfg).unwrap();
        let draws: Vec<bool> = (0..4000).map(|_| a.roll(Fault::TransferFail)).collect();
        let again: Vec<bool> = (0..4000).map(|_| b.roll(Fault::TransferFail)).collect();
        assert_eq!(draws, again, "same seed, same faults");
        let n = a.injected(Fault::TransferFail);
        assert!((800..1200).contains(&n), "{n} of 4000 at 25%");
        assert!(
            !a.actor_panics(ActorKind::TpWorker),
            "only the chosen actor panics"
        );
        assert_eq!(
            (0..10)
                .filter(|_| a.actor_panics(ActorKind::KvSender))
                .count(),
            2
        );
        assert_eq!(a.injected(Fault::ActorPanic), 2);
        assert!(!a.roll(Fault::ControlDrop), "rate 0 never fires");
    }

    #[test]
    fn a_delayed_spill_reports_its_delay_and_is_counted() {
        let f = FaultInjector::new(&FaultSection {
            spill_delay: 1.0,
            spill_delay_ms: 250,
            ..FaultSection::default()
        })
        .expect("active");
        assert_eq!(f.spill(), Some(Duration::from_millis(250)));
        assert_eq!(f.injected(Fault::SpillDelay), 1);
        assert_eq!(f.transfer(), TransferFault::Submit, "other kinds untouched");
        let bad = FaultSection {
            spill_delay: 2.0,
            ..FaultSection::default()
        };
        assert_eq!(bad.invalid().map(|(k, _)| k), Some("faults.spill_delay"));
    }
}
