//! Counted, restartable actor addresses.
//!
//! ractor keeps an actor's queue to itself (no length), so we count: a [`Mailbox`] adds one
//! to the actor's [`Inbox`] for every message it sends, and the actor takes one off as it
//! starts handling a message. `pdserve inspect` shows the difference as the mailbox depth.
//! Every message our actors exchange goes through a `Mailbox` (an actor's messages to itself
//! through [`Mailbox::of`]), so the count is of what is really queued; a message sent around
//! it would only make the figure low (the count never goes below zero).
//!
//! A `Mailbox` is also the stable address of a supervised child: when the supervisor
//! restarts the child it points the same `Mailbox` (every clone of it) at the new
//! incarnation with [`Mailbox::respawn_linked`], with a fresh count (the old incarnation's
//! queue died with it). Holders never keep a dead actor's address.

use pdserve_runtime::faults::FaultInjector;
use pdserve_runtime::supervision::ActorKind;
use ractor::rpc::CallResult;
use ractor::{Actor, ActorCell, ActorId, ActorRef, MessagingErr, RpcReplyPort, SpawnErr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::task::JoinHandle;

/// An actor incarnation's end of its [`Mailbox`]: the count of messages queued for it, and
/// the test-only panic hook of its slot. The actor calls [`Inbox::take`] first thing in
/// `Actor::handle`.
#[derive(Debug, Clone, Default)]
pub struct Inbox {
    queued: Arc<AtomicUsize>,
    hook: PanicHook,
}

impl Inbox {
    fn sent(&self) {
        self.queued.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one more message unless `capacity` are queued; the error is the depth.
    fn sent_within(&self, capacity: usize) -> Result<(), usize> {
        self.queued
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |d| {
                (d < capacity).then_some(d + 1)
            })
            .map(drop)
    }

    fn unsent(&self) {
        let _ = self
            .queued
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |d| d.checked_sub(1));
    }

    /// One message left the queue. Panics here when the slot's panic hook fires.
    pub fn take(&self) {
        self.unsent();
        self.hook.check();
    }

    /// Messages waiting now.
    pub fn depth(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }
}

/// Test-only "this actor panics" switch of one supervised slot (kept across restarts):
/// armed by hand ([`PanicHook::arm`], the next message panics) or drawn from the
/// `[faults]` section's `actor_panic` rate when this slot's kind is its target.
#[derive(Debug, Clone, Default)]
pub struct PanicHook {
    armed: Arc<AtomicBool>,
    kind: Option<ActorKind>,
    faults: Option<Arc<FaultInjector>>,
}

impl PanicHook {
    /// A hook for an actor of `kind`, drawing from `faults` when there are any.
    pub fn new(kind: ActorKind, faults: Option<Arc<FaultInjector>>) -> Self {
        Self {
            armed: Arc::default(),
            kind: Some(kind),
            faults,
        }
    }

    /// The actor panics at its next message.
    pub fn arm(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }

    fn check(&self) {
        let drawn = || match (&self.faults, self.kind) {
            (Some(f), Some(kind)) => f.actor_panics(kind),
            _ => false,
        };
        // A plain load first: the swap (a locked write) only when armed, not per message.
        let armed = self.armed.load(Ordering::Relaxed) && self.armed.swap(false, Ordering::SeqCst);
        if armed || drawn() {
            let kind = self.kind.map_or("an actor", ActorKind::as_str);
            panic!("injected fault: {kind} panics taking a message");
        }
    }
}

/// The address of an actor (or of a supervised child slot) that counts its mailbox.
///
/// [`Mailbox::cast`] and [`Mailbox::call`] always queue (the messages actors exchange among
/// themselves — step replies, worker events, timers — must not be lost). New work from
/// outside comes through [`Mailbox::offer`], which a mailbox given a capacity
/// ([`Mailbox::with_capacity`]) refuses as [`Refused::Overloaded`] once that many messages
/// wait: a flood shows as prompt refusals, not as a queue that grows without bound.
pub struct Mailbox<M> {
    slot: Arc<RwLock<(ActorRef<M>, Inbox)>>,
    /// Messages queued past which [`Mailbox::offer`] refuses (unbounded by default).
    capacity: usize,
}

impl<M> Clone for Mailbox<M> {
    fn clone(&self) -> Self {
        Self {
            slot: self.slot.clone(),
            capacity: self.capacity,
        }
    }
}

/// Why [`Mailbox::offer`] did not queue a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The actor is gone.
    Gone,
    /// `capacity` messages wait already.
    Overloaded {
        /// The mailbox's capacity.
        capacity: usize,
    },
}

impl<M> std::fmt::Debug for Mailbox<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (actor, inbox) = &*self.slot.read().unwrap_or_else(|e| e.into_inner());
        f.debug_struct("Mailbox")
            .field("actor", &actor.get_id())
            .field("depth", &inbox.depth())
            .finish()
    }
}

impl<M: ractor::Message> Mailbox<M> {
    /// The counted address of `actor`, whose handler takes from `inbox` (an actor's address
    /// for messages to itself: `Mailbox::of(&myself, &self.0)`).
    pub fn of(actor: &ActorRef<M>, inbox: &Inbox) -> Self {
        Self {
            slot: Arc::new(RwLock::new((actor.clone(), inbox.clone()))),
            capacity: usize::MAX,
        }
    }

    /// This address, whose [`Mailbox::offer`] refuses once `capacity` messages wait (at
    /// least one).
    pub fn with_capacity(mut self, capacity: usize) -> Self {
        self.capacity = capacity.max(1);
        self
    }

    /// The capacity [`Mailbox::offer`] keeps to (`usize::MAX`: none).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Spawns an unsupervised actor built by `make` from its inbox.
    ///
    /// # Errors
    /// As [`Actor::spawn`].
    pub async fn spawn<A: Actor<Msg = M>>(
        name: Option<String>,
        make: impl FnOnce(Inbox) -> A,
        args: A::Arguments,
    ) -> Result<(Self, JoinHandle<()>), SpawnErr> {
        let inbox = Inbox::default();
        let (actor, join) = Actor::spawn(name, make(inbox.clone()), args).await?;
        Ok((Self::of(&actor, &inbox), join))
    }

    /// Spawns an actor supervised by `supervisor`, with its slot's panic hook.
    ///
    /// # Errors
    /// As [`Actor::spawn_linked`].
    pub async fn spawn_linked<A: Actor<Msg = M>>(
        name: String,
        make: impl FnOnce(Inbox) -> A,
        args: A::Arguments,
        supervisor: ActorCell,
        hook: PanicHook,
    ) -> Result<(Self, JoinHandle<()>), SpawnErr> {
        let inbox = Inbox {
            queued: Arc::default(),
            hook,
        };
        let (actor, join) =
            Actor::spawn_linked(Some(name), make(inbox.clone()), args, supervisor).await?;
        Ok((Self::of(&actor, &inbox), join))
    }

    /// Restarts the slot: spawns a new incarnation (same panic hook, fresh count: the old
    /// queue died with the old actor) and points this mailbox, every clone of it, at it. The
    /// dead incarnation's registered name is released asynchronously: the new one waits for
    /// it (up to a second; after that the spawn reports the name as taken).
    ///
    /// # Errors
    /// As [`Actor::spawn_linked`]; the mailbox keeps pointing at the old (dead) actor.
    pub async fn respawn_linked<A: Actor<Msg = M>>(
        &self,
        name: String,
        make: impl FnOnce(Inbox) -> A,
        args: A::Arguments,
        supervisor: ActorCell,
    ) -> Result<JoinHandle<()>, SpawnErr> {
        for _ in 0..100 {
            if ractor::registry::where_is(name.clone()).is_none() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let inbox = Inbox {
            queued: Arc::default(),
            hook: self.current().1.hook,
        };
        let (actor, join) =
            Actor::spawn_linked(Some(name), make(inbox.clone()), args, supervisor).await?;
        *self.slot.write().unwrap_or_else(|e| e.into_inner()) = (actor, inbox);
        Ok(join)
    }

    /// The slot's panic hook.
    pub fn panic_hook(&self) -> PanicHook {
        self.current().1.hook
    }

    fn current(&self) -> (ActorRef<M>, Inbox) {
        self.slot.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Sends `msg` without waiting.
    ///
    /// # Errors
    /// When the actor is gone (the message comes back).
    pub fn cast(&self, msg: M) -> Result<(), MessagingErr<M>> {
        let (actor, inbox) = self.current();
        inbox.sent();
        actor.cast(msg).inspect_err(|_| inbox.unsent())
    }

    /// Sends `msg` without waiting, unless the mailbox already holds its capacity.
    ///
    /// # Errors
    /// [`Refused::Overloaded`] when `capacity` messages wait; [`Refused::Gone`] when the
    /// actor is gone.
    pub fn offer(&self, msg: M) -> Result<(), Refused> {
        let (actor, inbox) = self.current();
        let capacity = self.capacity;
        if inbox.sent_within(capacity).is_err() {
            return Err(Refused::Overloaded { capacity });
        }
        actor.cast(msg).map_err(|_| {
            inbox.unsent();
            Refused::Gone
        })
    }

    /// Sends `msg` to this actor of `kind`, for a sender that has nothing else to do when the
    /// receiver is gone (its supervisor reports the death and fails what it held). A lost
    /// message is counted (`pdserve_actor_messages_undelivered_total{actor, message}`) and
    /// logged, never dropped silently. Returns whether it was queued.
    pub fn tell(&self, kind: ActorKind, what: &'static str, msg: M) -> bool {
        use pdserve_runtime::telemetry as m;
        if self.cast(msg).is_ok() {
            return true;
        }
        metrics::counter!(m::ACTOR_MESSAGES_UNDELIVERED_TOTAL,
            m::LABEL_ACTOR => kind.as_str(), m::LABEL_MESSAGE => what)
        .increment(1);
        tracing::debug!(
            actor = kind.as_str(),
            message = what,
            "message not delivered: the actor is gone"
        );
        false
    }

    /// Sends the message `build` makes around a reply port and waits for the reply (at most
    /// `timeout`). Same contract as `ActorRef::call`, so `ractor::call_t!` works on it.
    ///
    /// # Errors
    /// When the actor is gone before the message is queued.
    pub async fn call<T: Send + 'static>(
        &self,
        build: impl FnOnce(RpcReplyPort<T>) -> M,
        timeout: Option<Duration>,
    ) -> Result<CallResult<T>, MessagingErr<M>> {
        let (actor, inbox) = self.current();
        inbox.sent();
        let result = actor.call(build, timeout).await;
        if result.is_err() {
            inbox.unsent(); // never queued
        }
        result
    }

    /// Messages waiting in the current incarnation's mailbox.
    pub fn depth(&self) -> usize {
        self.current().1.depth()
    }

    /// The current incarnation.
    pub fn get_cell(&self) -> ActorCell {
        self.current().0.get_cell()
    }

    /// The current incarnation's id.
    pub fn get_id(&self) -> ActorId {
        self.current().0.get_id()
    }

    /// Stops the current incarnation.
    pub fn stop(&self, reason: Option<String>) {
        self.current().0.stop(reason);
    }
}

/// What a supervisor reads of a child's [`Mailbox`], whatever the child's messages: one
/// trait instead of a match per question over every kind of child.
pub trait Supervised {
    /// Messages queued for the current incarnation.
    fn depth(&self) -> usize;
    /// The current incarnation.
    fn get_cell(&self) -> ActorCell;
    /// The slot's test-only panic hook.
    fn panic_hook(&self) -> PanicHook;
}

impl<M: ractor::Message> Supervised for Mailbox<M> {
    fn depth(&self) -> usize {
        Mailbox::depth(self)
    }
    fn get_cell(&self) -> ActorCell {
        Mailbox::get_cell(self)
    }
    fn panic_hook(&self) -> PanicHook {
        Mailbox::panic_hook(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ractor::ActorProcessingErr;
    use tokio::sync::Semaphore;

    /// Takes one message per permit; answers `Echo` with its own id.
    struct Gate(Inbox);

    enum GateMsg {
        Wait,
        Echo(RpcReplyPort<ActorId>),
    }

    impl Actor for Gate {
        type Msg = GateMsg;
        type State = Arc<Semaphore>;
        type Arguments = Arc<Semaphore>;

        async fn pre_start(
            &self,
            _: ActorRef<GateMsg>,
            gate: Arc<Semaphore>,
        ) -> Result<Arc<Semaphore>, ActorProcessingErr> {
            Ok(gate)
        }

        async fn handle(
            &self,
            myself: ActorRef<GateMsg>,
            msg: GateMsg,
            gate: &mut Arc<Semaphore>,
        ) -> Result<(), ActorProcessingErr> {
            self.0.take();
            match msg {
                GateMsg::Wait => gate.acquire().await?.forget(),
                GateMsg::Echo(reply) => {
                    let _ = reply.send(myself.get_id());
                }
            }
            Ok(())
        }
    }

    async fn settle(m: &Mailbox<GateMsg>, depth: usize) {
        for _ in 0..500 {
            if m.depth() == depth {
                return;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert_eq!(m.depth(), depth);
    }

    #[tokio::test]
    async fn the_depth_is_what_waits_in_the_queue() {
        let gate = Arc::new(Semaphore::new(0));
        let (m, _join) = Mailbox::spawn(None, Gate, gate.clone()).await.unwrap();
        assert_eq!(m.depth(), 0);
        for _ in 0..5 {
            m.cast(GateMsg::Wait).unwrap();
        }
        // The first is being handled (blocked on the gate); four wait behind it.
        settle(&m, 4).await;
        gate.add_permits(2);
        settle(&m, 2).await;
        gate.add_permits(3);
        settle(&m, 0).await;
        // A call is counted while queued and taken when handled.
        let id = ractor::call_t!(m, GateMsg::Echo, 1_000).unwrap();
        assert_eq!(id, m.get_id());
        assert_eq!(m.depth(), 0);
        // Sends to a stopped actor fail and leave nothing counted.
        m.stop(None);
        for _ in 0..500 {
            if m.cast(GateMsg::Wait).is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert!(m.cast(GateMsg::Wait).is_err());
    }

    #[tokio::test]
    async fn offers_past_the_capacity_are_refused_and_casts_are_not() {
        let gate = Arc::new(Semaphore::new(0));
        let (m, _join) = Mailbox::spawn(None, Gate, gate.clone()).await.unwrap();
        let m = m.with_capacity(2);
        m.cast(GateMsg::Wait).unwrap();
        settle(&m, 0).await; // taken, blocked on the gate
        m.offer(GateMsg::Wait).unwrap();
        m.offer(GateMsg::Wait).unwrap();
        assert_eq!(
            m.offer(GateMsg::Wait),
            Err(Refused::Overloaded { capacity: 2 })
        );
        assert_eq!(m.depth(), 2, "a refused offer is not counted");
        // The actors' own messages still queue past it.
        m.cast(GateMsg::Wait).unwrap();
        assert_eq!(m.depth(), 3);
        // Once the queue drains below the capacity, offers are taken again.
        gate.add_permits(4);
        settle(&m, 0).await;
        m.offer(GateMsg::Wait).unwrap();
        gate.add_permits(1);
        settle(&m, 0).await;
        m.stop(None);
        for _ in 0..500 {
            if m.offer(GateMsg::Wait).is_err() {
                break;
            }
            gate.add_permits(1);
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert_eq!(m.offer(GateMsg::Wait), Err(Refused::Gone));
    }

    /// Restarts its one child with `respawn_linked` when it fails.
    struct Sup(Arc<Semaphore>, tokio::sync::mpsc::UnboundedSender<()>);

    impl Actor for Sup {
        type Msg = ();
        type State = Option<Mailbox<GateMsg>>;
        type Arguments = tokio::sync::oneshot::Sender<Mailbox<GateMsg>>;

        async fn pre_start(
            &self,
            myself: ActorRef<()>,
            out: Self::Arguments,
        ) -> Result<Self::State, ActorProcessingErr> {
            let hook = PanicHook::new(ActorKind::TpWorker, None);
            let (m, _) = Mailbox::spawn_linked(
                "mailbox-test-gate".into(),
                Gate,
                self.0.clone(),
                myself.get_cell(),
                hook,
            )
            .await?;
            let _ = out.send(m.clone());
            Ok(Some(m))
        }

        async fn handle_supervisor_evt(
            &self,
            myself: ActorRef<()>,
            evt: ractor::SupervisionEvent,
            st: &mut Self::State,
        ) -> Result<(), ActorProcessingErr> {
            if let (ractor::SupervisionEvent::ActorFailed(..), Some(m)) = (evt, st) {
                m.respawn_linked(
                    "mailbox-test-gate".into(),
                    Gate,
                    self.0.clone(),
                    myself.get_cell(),
                )
                .await?;
                let _ = self.1.send(());
            }
            Ok(())
        }
    }

    #[tokio::test]
    async fn an_armed_hook_panics_and_a_respawn_repoints_every_clone() {
        let gate = Arc::new(Semaphore::new(0));
        let (restarted_tx, mut restarted) = tokio::sync::mpsc::unbounded_channel();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (sup, _join) = Actor::spawn(None, Sup(gate.clone(), restarted_tx), tx)
            .await
            .unwrap();
        let m = rx.await.unwrap();
        let held = m.clone();
        let before = ractor::call_t!(m, GateMsg::Echo, 1_000).unwrap();
        // Queue two behind a blocked one, then make the next message taken panic.
        for _ in 0..3 {
            m.cast(GateMsg::Wait).unwrap();
        }
        settle(&m, 2).await;
        m.panic_hook().arm();
        gate.add_permits(1);
        tokio::time::timeout(Duration::from_secs(5), restarted.recv())
            .await
            .expect("restarted")
            .unwrap();
        // The clone taken before the restart reaches the new incarnation; its queue is new.
        assert_eq!(held.depth(), 0, "the dead incarnation's queue is gone");
        let after = ractor::call_t!(held, GateMsg::Echo, 1_000).unwrap();
        assert_ne!(before, after);
        assert_eq!(after, m.get_id());
        sup.stop(None);
    }
}
