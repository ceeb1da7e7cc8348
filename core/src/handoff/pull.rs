//! [`PullCore`]: the decode side of one KV hand-off as a state machine — events in, actions
//! out, time passed in; no tokio, no I/O. The KvReceiver runs one driver task per hand-off
//! that performs the actions and feeds their outcomes back (`pdserve_actors::handoff::receiver`).
//!
//! Three shapes ([`Shape`]):
//! - **held** (vLLM's two-hop flow): the prefill instance already holds the prompt's blocks;
//!   read them, then release the lease;
//! - **drive, pull**: ask the prefill instance to run the prompt and hold its blocks
//!   ([`PullAction::SendPrefill`]), then read and release as above;
//! - **drive, push**: ask it to run the prompt and write every layer into our destination
//!   blocks; its answer comes once its last write finished.
//!
//! Two obligations end every hand-off, each exactly once: [`PullAction::Finish`] (the
//! request's outcome, to the Scheduler) and [`PullAction::ReleaseBlocks`] (our hold on the
//! destination blocks goes back). The second waits until no byte can land in them any more:
//! after our reads ended (the transfer engine's landing fence guarantees nothing lands after
//! a batch ended), and in push mode after the prefill instance confirmed its writes stopped
//! (its answer, or its answer to our abort) — or, when it cannot say (dead, partitioned), one
//! transfer bound later (quarantine: a writer that saw the abort submits nothing new and
//! every write in flight ends within that bound).
//!
//! A cancel (the client went away) never cuts a read short; it turns the outcome into
//! [`HandoffError::Aborted`] and, while waiting for the prefill instance, sends it an abort.

use super::HandoffError;
use pdserve_runtime::ids::TransferId;
use std::time::{Duration, Instant};

/// Where the KV comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Shape {
    /// Computed and held already (vLLM's two-hop flow): the held blocks and T0.
    Held {
        /// The prefill instance's blocks.
        block_ids: Vec<u32>,
        /// T0.
        first_token: u32,
        /// How long they are held unless renewed, when the peer said.
        lease: Option<Duration>,
    },
    /// We ask the prefill instance; it holds the blocks for us to read.
    DrivePull,
    /// We ask the prefill instance; it writes into our blocks.
    DrivePush,
}

/// Bounds of a hand-off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PullBounds {
    /// Every transfer step (a batch, a lease call, an abort); also the quarantine.
    pub transfer: Duration,
    /// The remote prefill (the prompt's whole forward pass).
    pub prefill: Duration,
}

/// What of the prefill instance's answer to our Prefill request this core acts on (the
/// driver keeps the rest: T0's logprobs, its timing, its cached-token count).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prefilled {
    /// T0.
    pub first_token: u32,
    /// Pull: the blocks it holds for us. Push: `None` (every write has finished).
    pub held: Option<Held>,
}

/// Blocks a prefill instance holds for our read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Held {
    /// The prompt's blocks, in order.
    pub block_ids: Vec<u32>,
    /// How long they stay held unless renewed.
    pub lease: Duration,
}

/// What happened.
#[derive(Clone, Debug, PartialEq)]
pub enum PullEvent {
    /// The prefill instance answered our Prefill request (checked by the driver: T0 inside
    /// the vocabulary, the answer for this transfer).
    Prefilled(Prefilled),
    /// Our Prefill request failed. `answered`: the prefill instance itself answered with the
    /// failure (so its writes, if any, have drained); otherwise no answer came (the carrier
    /// failed, a timeout) and its writes may still be in flight.
    PrefillFailed {
        /// Why.
        error: HandoffError,
        /// Whether the peer answered.
        answered: bool,
    },
    /// Every read batch ended (pull); `Ok` when every rank read its share.
    ReadsDone(Result<(), HandoffError>),
    /// The reads never started: the held blocks' description was refused before any byte
    /// moved (a layout mismatch, forged block ids, no session). When the blocks were named by
    /// the request's parameters nothing is released at the prefill instance: they may not be
    /// ours to act on (its lease frees them).
    ReadsRefused(HandoffError),
    /// The answer to our release: whether the lease was still alive.
    Released(Result<bool, HandoffError>),
    /// The answer to our abort: `Ok` once the prefill instance confirmed that nothing of the
    /// hand-off can be written any more.
    AbortAnswered(Result<(), HandoffError>),
    /// The request was aborted (the client went away).
    Cancel,
}

/// What the driver must do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PullAction {
    /// Send the Prefill request (pull or push, by the shape); answer with
    /// [`PullEvent::Prefilled`] or [`PullEvent::PrefillFailed`].
    SendPrefill,
    /// Read the held blocks into ours (handshake, plan, one batch per rank, joined by the
    /// Aggregator), renewing the lease while reading; answer with [`PullEvent::ReadsDone`].
    Read {
        /// The prefill instance's blocks.
        block_ids: Vec<u32>,
        /// Their lease, when the peer said.
        lease: Option<Duration>,
    },
    /// Release the held blocks; answer with [`PullEvent::Released`].
    SendRelease,
    /// Tell the prefill instance to stop; answer with [`PullEvent::AbortAnswered`].
    SendAbort,
    /// The request's outcome: T0, or why it failed. Exactly once.
    Finish(Result<u32, HandoffError>),
    /// Our hold on the destination blocks goes back: no byte can land in them any more.
    /// Exactly once.
    ReleaseBlocks,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Phase {
    /// Waiting for the Prefill answer.
    AwaitPrefill { deadline: Instant },
    /// Reads in flight.
    Reading,
    /// Release sent after a successful read.
    Releasing,
    /// Push, abandoned: waiting for the writer to confirm it stopped.
    Draining,
    /// Push, abandoned, no confirmation: blocks held until then.
    Quarantine { until: Instant },
    /// Decided; waiting only for the answers to calls still out.
    Closing,
}

/// Calls whose answers are still due.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Outstanding {
    prefill: bool,
    read: bool,
    release: bool,
    abort: bool,
}

/// The decode side of one hand-off.
#[derive(Clone, Debug)]
pub struct PullCore {
    transfer: TransferId,
    push: bool,
    /// The held blocks were named by the request's parameters (vLLM's two-hop flow), not by an
    /// answer to our own Prefill call.
    held_by_params: bool,
    bounds: PullBounds,
    phase: Phase,
    first_token: Option<u32>,
    cancelled: bool,
    finished: bool,
    blocks_released: bool,
    out: Outstanding,
}

impl PullCore {
    /// A hand-off of `transfer` in `shape`, starting at `now`; returns the core and its first
    /// actions.
    pub fn start(
        transfer: TransferId,
        shape: Shape,
        bounds: PullBounds,
        now: Instant,
    ) -> (Self, Vec<PullAction>) {
        let mut core = Self {
            transfer,
            push: shape == Shape::DrivePush,
            held_by_params: matches!(shape, Shape::Held { .. }),
            bounds,
            phase: Phase::Closing,
            first_token: None,
            cancelled: false,
            finished: false,
            blocks_released: false,
            out: Outstanding::default(),
        };
        let actions = match shape {
            Shape::Held {
                block_ids,
                first_token,
                lease,
            } => {
                core.first_token = Some(first_token);
                core.phase = Phase::Reading;
                core.out.read = true;
                vec![PullAction::Read { block_ids, lease }]
            }
            Shape::DrivePull | Shape::DrivePush => {
                core.phase = Phase::AwaitPrefill {
                    deadline: now + bounds.prefill,
                };
                core.out.prefill = true;
                vec![PullAction::SendPrefill]
            }
        };
        (core, actions)
    }

    /// The hand-off.
    pub fn transfer(&self) -> TransferId {
        self.transfer
    }

    /// When [`PullCore::tick`] has something to do, if ever.
    pub fn deadline(&self) -> Option<Instant> {
        match self.phase {
            Phase::AwaitPrefill { deadline } => Some(deadline),
            Phase::Quarantine { until } => Some(until),
            _ => None,
        }
    }

    /// Whether both obligations are met and no answer is due: the driver may end.
    pub fn is_done(&self) -> bool {
        self.finished && self.blocks_released && self.out == Outstanding::default()
    }

    /// Whether the outcome was sent.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Applies an event at `now`.
    pub fn on(&mut self, event: PullEvent, now: Instant) -> Vec<PullAction> {
        let mut a = Vec::new();
        match event {
            PullEvent::Prefilled(answer) => {
                self.out.prefill = false;
                self.on_prefilled(answer, &mut a);
            }
            PullEvent::PrefillFailed { error, answered } => {
                self.out.prefill = false;
                self.on_prefill_failed(error, answered, now, &mut a);
            }
            PullEvent::ReadsDone(result) => {
                self.out.read = false;
                if self.phase == Phase::Reading {
                    match result {
                        Ok(()) if self.cancelled => {
                            self.send_release(&mut a);
                            self.close(Err(HandoffError::Aborted), &mut a);
                        }
                        Ok(()) => {
                            self.send_release(&mut a);
                            self.phase = Phase::Releasing;
                        }
                        Err(e) => {
                            // Best effort: the prefill instance frees its blocks now rather
                            // than at lease expiry.
                            self.send_release(&mut a);
                            self.close(Err(e), &mut a);
                        }
                    }
                }
            }
            PullEvent::ReadsRefused(e) => {
                self.out.read = false;
                if self.phase == Phase::Reading {
                    // Blocks the prefill instance holds because we asked are ours to free;
                    // blocks named by a request's parameters may be someone else's.
                    if !self.held_by_params {
                        self.send_release(&mut a);
                    }
                    self.close(Err(e), &mut a);
                }
            }
            PullEvent::Released(result) => {
                self.out.release = false;
                if self.phase == Phase::Releasing {
                    let outcome = match result {
                        Ok(true) if self.cancelled => Err(HandoffError::Aborted),
                        Ok(true) => Ok(self.first_token.expect("set before reading")),
                        Ok(false) => Err(HandoffError::LeaseExpired(self.transfer)),
                        Err(e) => Err(e),
                    };
                    self.close(outcome, &mut a);
                }
            }
            PullEvent::AbortAnswered(result) => {
                self.out.abort = false;
                if matches!(self.phase, Phase::Draining | Phase::Quarantine { .. }) {
                    match result {
                        Ok(()) => self.drained(&mut a),
                        Err(_) if self.phase == Phase::Draining => {
                            // The writer cannot confirm: hold the blocks one more transfer
                            // bound (its writes in flight end within it), unless its Prefill
                            // answer comes first.
                            self.phase = Phase::Quarantine {
                                until: now + self.bounds.transfer,
                            };
                        }
                        Err(_) => {}
                    }
                }
            }
            PullEvent::Cancel => {
                if !self.cancelled && !self.finished {
                    self.cancelled = true;
                    if let Phase::AwaitPrefill { .. } = self.phase {
                        self.abandon(HandoffError::Aborted, &mut a);
                    }
                }
            }
        }
        a
    }

    /// Lets time pass: a Prefill answer overdue, a quarantine over.
    pub fn tick(&mut self, now: Instant) -> Vec<PullAction> {
        let mut a = Vec::new();
        match self.phase {
            Phase::AwaitPrefill { deadline } if now >= deadline => {
                let e = HandoffError::timeout("remote prefill", self.bounds.prefill);
                self.abandon(e, &mut a);
            }
            Phase::Quarantine { until } if now >= until => self.drained(&mut a),
            _ => {}
        }
        a
    }

    fn on_prefilled(&mut self, answer: Prefilled, a: &mut Vec<PullAction>) {
        match self.phase {
            Phase::AwaitPrefill { .. } => match (self.push, answer.held) {
                (false, Some(held)) => {
                    self.first_token = Some(answer.first_token);
                    self.phase = Phase::Reading;
                    self.out.read = true;
                    a.push(PullAction::Read {
                        block_ids: held.block_ids,
                        lease: Some(held.lease),
                    });
                }
                (true, None) => self.close(Ok(answer.first_token), a),
                (false, None) => self.close(
                    Err(HandoffError::Protocol(
                        "the prefill instance answered a pull without held blocks".into(),
                    )),
                    a,
                ),
                (true, Some(_)) => {
                    // Its writes are done (it answered), but it holds blocks we never read.
                    self.send_release(a);
                    self.close(
                        Err(HandoffError::Protocol(
                            "the prefill instance answered a push with held blocks".into(),
                        )),
                        a,
                    );
                }
            },
            // The writer answered: every write of the hand-off has ended.
            Phase::Draining | Phase::Quarantine { .. } => self.drained(a),
            _ => {}
        }
    }

    fn on_prefill_failed(
        &mut self,
        error: HandoffError,
        answered: bool,
        now: Instant,
        a: &mut Vec<PullAction>,
    ) {
        match self.phase {
            Phase::AwaitPrefill { .. } if answered => self.close(Err(error), a),
            Phase::AwaitPrefill { .. } => self.abandon(error, a),
            Phase::Draining | Phase::Quarantine { .. } if answered => self.drained(a),
            Phase::Draining if !self.out.abort => {
                // Neither answer will confirm the writes stopped.
                self.phase = Phase::Quarantine {
                    until: now + self.bounds.transfer,
                };
            }
            _ => {}
        }
    }

    /// Gives up while the Prefill request is out: tells the prefill instance, answers the
    /// request at once, and (push) keeps the blocks until the writer confirmed it stopped.
    fn abandon(&mut self, error: HandoffError, a: &mut Vec<PullAction>) {
        self.out.abort = true;
        a.push(PullAction::SendAbort);
        if self.push {
            self.finish(Err(error), a);
            self.phase = Phase::Draining;
        } else {
            // Nothing writes into our blocks in pull mode.
            self.close(Err(error), a);
        }
    }

    fn send_release(&mut self, a: &mut Vec<PullAction>) {
        self.out.release = true;
        a.push(PullAction::SendRelease);
    }

    fn finish(&mut self, outcome: Result<u32, HandoffError>, a: &mut Vec<PullAction>) {
        if !self.finished {
            self.finished = true;
            a.push(PullAction::Finish(outcome));
        }
    }

    fn drained(&mut self, a: &mut Vec<PullAction>) {
        if !self.blocks_released {
            self.blocks_released = true;
            a.push(PullAction::ReleaseBlocks);
        }
        self.phase = Phase::Closing;
    }

    /// Decides and gives the blocks back (no byte can land).
    fn close(&mut self, outcome: Result<u32, HandoffError>, a: &mut Vec<PullAction>) {
        self.finish(outcome, a);
        self.drained(a);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const T: TransferId = TransferId(42);
    const BOUNDS: PullBounds = PullBounds {
        transfer: Duration::from_secs(5),
        prefill: Duration::from_secs(60),
    };

    fn answer(held: bool) -> Prefilled {
        Prefilled {
            first_token: 7,
            held: held.then(|| Held {
                block_ids: vec![3, 4],
                lease: Duration::from_millis(30_000),
            }),
        }
    }

    fn gone() -> HandoffError {
        HandoffError::PeerGone {
            peer: "p".into(),
            reason: "killed".into(),
        }
    }

    #[test]
    fn a_drive_pull_reads_then_releases_then_finishes() {
        let t0 = Instant::now();
        let (mut c, a) = PullCore::start(T, Shape::DrivePull, BOUNDS, t0);
        assert_eq!(a, vec![PullAction::SendPrefill]);
        let a = c.on(PullEvent::Prefilled(answer(true)), t0);
        assert!(matches!(&a[..], [PullAction::Read { block_ids, .. }] if block_ids == &[3, 4]));
        assert_eq!(
            c.on(PullEvent::ReadsDone(Ok(())), t0),
            vec![PullAction::SendRelease]
        );
        assert_eq!(
            c.on(PullEvent::Released(Ok(true)), t0),
            vec![PullAction::Finish(Ok(7)), PullAction::ReleaseBlocks]
        );
        assert!(c.is_done());
    }

    #[test]
    fn an_expired_lease_fails_loudly() {
        let t0 = Instant::now();
        let (mut c, _) = PullCore::start(
            T,
            Shape::Held {
                block_ids: vec![1],
                first_token: 3,
                lease: None,
            },
            BOUNDS,
            t0,
        );
        c.on(PullEvent::ReadsDone(Ok(())), t0);
        assert_eq!(
            c.on(PullEvent::Released(Ok(false)), t0),
            vec![
                PullAction::Finish(Err(HandoffError::LeaseExpired(T))),
                PullAction::ReleaseBlocks
            ]
        );
    }

    #[test]
    fn refused_reads_release_nothing_at_the_prefill_instance() {
        let t0 = Instant::now();
        let (mut c, _) = PullCore::start(
            T,
            Shape::Held {
                block_ids: vec![99_999],
                first_token: 3,
                lease: None,
            },
            BOUNDS,
            t0,
        );
        let e = HandoffError::InvalidBlocks("outside the pool".into());
        assert_eq!(
            c.on(PullEvent::ReadsRefused(e.clone()), t0),
            vec![PullAction::Finish(Err(e)), PullAction::ReleaseBlocks],
            "no SendRelease: forged parameters must not free someone else's lease"
        );
        assert!(c.is_done());
    }

    #[test]
    fn a_cancel_never_cuts_a_read_short() {
        let t0 = Instant::now();
        let (mut c, _) = PullCore::start(T, Shape::DrivePull, BOUNDS, t0);
        c.on(PullEvent::Prefilled(answer(true)), t0);
        assert!(c.on(PullEvent::Cancel, t0).is_empty(), "reads go on");
        let a = c.on(PullEvent::ReadsDone(Ok(())), t0);
        assert_eq!(
            a,
            vec![
                PullAction::SendRelease,
                PullAction::Finish(Err(HandoffError::Aborted)),
                PullAction::ReleaseBlocks
            ]
        );
        assert!(!c.is_done(), "the release answer is still due");
        c.on(PullEvent::Released(Ok(true)), t0);
        assert!(c.is_done());
    }

    #[test]
    fn a_push_abandoned_after_a_lost_answer_is_quarantined_one_transfer_bound() {
        let t0 = Instant::now();
        let (mut c, _) = PullCore::start(T, Shape::DrivePush, BOUNDS, t0);
        let a = c.on(
            PullEvent::PrefillFailed {
                error: gone(),
                answered: false,
            },
            t0,
        );
        assert_eq!(
            a,
            vec![PullAction::SendAbort, PullAction::Finish(Err(gone()))],
            "the request fails at once, the blocks stay"
        );
        assert!(c.on(PullEvent::AbortAnswered(Err(gone())), t0).is_empty());
        assert_eq!(c.deadline(), Some(t0 + BOUNDS.transfer));
        assert!(c.tick(t0 + BOUNDS.transfer / 2).is_empty());
        assert_eq!(
            c.tick(t0 + BOUNDS.transfer),
            vec![PullAction::ReleaseBlocks]
        );
        assert!(c.is_done());
    }

    #[test]
    fn a_cancelled_push_releases_once_the_writer_confirms() {
        let t0 = Instant::now();
        let (mut c, _) = PullCore::start(T, Shape::DrivePush, BOUNDS, t0);
        assert_eq!(
            c.on(PullEvent::Cancel, t0),
            vec![
                PullAction::SendAbort,
                PullAction::Finish(Err(HandoffError::Aborted))
            ]
        );
        assert_eq!(
            c.on(PullEvent::AbortAnswered(Ok(())), t0),
            vec![PullAction::ReleaseBlocks]
        );
        assert!(!c.is_done(), "the Prefill answer is still due");
        assert!(c
            .on(
                PullEvent::PrefillFailed {
                    error: HandoffError::Aborted,
                    answered: true
                },
                t0
            )
            .is_empty());
        assert!(c.is_done());
    }

    #[test]
    fn a_prefill_timeout_aborts_and_a_pull_frees_at_once() {
        let t0 = Instant::now();
        let (mut c, _) = PullCore::start(T, Shape::DrivePull, BOUNDS, t0);
        let a = c.tick(t0 + BOUNDS.prefill);
        assert_eq!(a.len(), 3, "{a:?}");
        assert_eq!(a[0], PullAction::SendAbort);
        assert!(matches!(
            a[1],
            PullAction::Finish(Err(HandoffError::Timeout { .. }))
        ));
        assert_eq!(a[2], PullAction::ReleaseBlocks);
        // A late answer holding blocks for us: the abort frees them at the prefill side.
        assert!(c.on(PullEvent::Prefilled(answer(true)), t0).is_empty());
        c.on(PullEvent::AbortAnswered(Ok(())), t0);
        assert!(c.is_done());
    }

    /// The driver, simulated: every call the core makes is answered later in any order, with
    /// any outcome; cancels and time arrive in between.
    #[derive(Debug, Clone)]
    enum Step {
        Deliver(usize, u8),
        Cancel,
        Advance(u64),
    }

    fn steps() -> impl Strategy<Value = Vec<Step>> {
        proptest::collection::vec(
            prop_oneof![
                4 => (0usize..4, any::<u8>()).prop_map(|(i, o)| Step::Deliver(i, o)),
                1 => Just(Step::Cancel),
                1 => (0u64..90_000).prop_map(Step::Advance),
            ],
            0..24,
        )
    }

    #[derive(Default)]
    struct Sim {
        pending: Vec<PullAction>,
        finished: Vec<Result<u32, HandoffError>>,
        released: usize,
        reads_out: usize,
        writer_stopped: bool,
        quarantine_from: Option<Instant>,
        read_ok: bool,
        release_said_held: bool,
    }

    impl Sim {
        fn apply(&mut self, c: &PullCore, actions: Vec<PullAction>, now: Instant) {
            for a in actions {
                match a {
                    PullAction::Finish(r) => self.finished.push(r),
                    PullAction::ReleaseBlocks => {
                        self.released += 1;
                        assert_eq!(self.reads_out, 0, "blocks released under a read");
                        if c.push {
                            let waited = self
                                .quarantine_from
                                .is_some_and(|q| now >= q + BOUNDS.transfer);
                            assert!(
                                self.writer_stopped || waited,
                                "push blocks released before the writer stopped or the quarantine ended"
                            );
                        }
                    }
                    PullAction::Read { .. } => {
                        self.reads_out += 1;
                        self.pending.push(a);
                    }
                    other => self.pending.push(other),
                }
            }
        }

        /// The event answering pending call `i` with outcome `o`.
        fn answer(&mut self, i: usize, o: u8, push: bool, now: Instant) -> Option<PullEvent> {
            if self.pending.is_empty() {
                return None;
            }
            let call = self.pending.remove(i % self.pending.len());
            let ok = !o.is_multiple_of(3);
            Some(match call {
                PullAction::SendPrefill => {
                    if ok {
                        self.writer_stopped |= push;
                        PullEvent::Prefilled(answer(!push))
                    } else {
                        let answered = o.is_multiple_of(2);
                        self.writer_stopped |= answered;
                        if !answered && self.quarantine_from.is_none() {
                            self.quarantine_from = Some(now);
                        }
                        PullEvent::PrefillFailed {
                            error: gone(),
                            answered,
                        }
                    }
                }
                PullAction::Read { .. } => {
                    self.reads_out -= 1;
                    self.read_ok = ok;
                    match (ok, o % 2) {
                        (true, _) => PullEvent::ReadsDone(Ok(())),
                        (false, 0) => PullEvent::ReadsDone(Err(gone())),
                        (false, _) => {
                            PullEvent::ReadsRefused(HandoffError::InvalidBlocks("forged".into()))
                        }
                    }
                }
                PullAction::SendRelease => {
                    self.release_said_held = ok && o % 2 == 1;
                    PullEvent::Released(if ok { Ok(o % 2 == 1) } else { Err(gone()) })
                }
                PullAction::SendAbort => {
                    if ok {
                        self.writer_stopped = true;
                        PullEvent::AbortAnswered(Ok(()))
                    } else {
                        // The quarantine is measured from when confirmation failed.
                        self.quarantine_from = Some(now);
                        PullEvent::AbortAnswered(Err(gone()))
                    }
                }
                other => unreachable!("{other:?} is not a call"),
            })
        }
    }

    fn shapes() -> impl Strategy<Value = Shape> {
        prop_oneof![
            Just(Shape::DrivePull),
            Just(Shape::DrivePush),
            Just(Shape::Held {
                block_ids: vec![1, 2],
                first_token: 7,
                lease: None
            }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

        /// Whatever happens, in whatever order: the outcome is sent exactly once, the blocks
        /// go back exactly once and never while a byte can still land, a success means the
        /// KV really arrived, and the driver ends once every call is answered and time passed.
        #[test]
        fn every_interleaving_ends_once_and_frees_once(shape in shapes(), steps in steps()) {
            let t0 = Instant::now();
            let mut now = t0;
            let push = shape == Shape::DrivePush;
            let (mut c, first) = PullCore::start(T, shape, BOUNDS, t0);
            let mut sim = Sim::default();
            sim.apply(&c, first, now);
            let mut cancelled = false;
            for step in steps {
                let actions = match step {
                    Step::Deliver(i, o) => match sim.answer(i, o, push, now) {
                        Some(ev) => c.on(ev, now),
                        None => Vec::new(),
                    },
                    Step::Cancel => {
                        cancelled |= sim.finished.is_empty();
                        c.on(PullEvent::Cancel, now)
                    }
                    Step::Advance(ms) => {
                        now += Duration::from_millis(ms);
                        c.tick(now)
                    }
                };
                sim.apply(&c, actions, now);
                prop_assert!(sim.finished.len() <= 1, "two outcomes: {:?}", sim.finished);
                prop_assert!(sim.released <= 1, "blocks released twice");
            }
            // Drain: answer everything (successfully), let time pass, until the driver ends.
            for _ in 0..16 {
                while !sim.pending.is_empty() {
                    let ev = sim.answer(0, 1, push, now).unwrap();
                    let a = c.on(ev, now);
                    sim.apply(&c, a, now);
                }
                now += BOUNDS.prefill + BOUNDS.transfer;
                let a = c.tick(now);
                sim.apply(&c, a, now);
                if c.is_done() { break; }
            }
            prop_assert!(c.is_done(), "the hand-off never ended: {c:?}");
            prop_assert_eq!(sim.finished.len(), 1);
            prop_assert_eq!(sim.released, 1);
            if let Ok(t) = &sim.finished[0] {
                prop_assert_eq!(*t, 7);
                if !push {
                    prop_assert!(sim.read_ok && sim.release_said_held, "success without a read and a live lease");
                }
                prop_assert!(!cancelled, "finished Ok after a cancel");
            }
        }
    }
}
