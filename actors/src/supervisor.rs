//! The InstanceSupervisor: starts an instance's actors and keeps them alive.
//!
//! Policy, written out (one-for-one, each child under its own [`RestartPolicy`] budget,
//! default 3 in 60 s; a child that keeps failing escalates: the supervisor fails, which
//! stops the instance instead of looping — `pdserve launch` then restarts the process):
//! - a **TpWorker** is restarted with a new epoch, a fresh shard and KV region, after the
//!   Scheduler has failed the step it was running (those requests end with a 5xx, their
//!   blocks return to the pool); the rank's hand-off epoch moves on and the Aggregator fails
//!   the hand-offs that waited on its old cache;
//! - the **Aggregator**, **KvSender** and **KvReceiver** are restarted in place: everyone
//!   reaches them through a [`Mailbox`] the restart re-points. What a failed incarnation
//!   had open ends with it and is failed explicitly (hand-off waiters see their channel
//!   close; see each actor's docs), nothing waits for it. A KvSender or KvReceiver restart
//!   moves every rank's hand-off epoch on: late reports of the old incarnation's hand-offs
//!   are stale;
//! - a failed **Scheduler** or **HttpFrontend** escalates at once: the requests the
//!   Scheduler held (and the block pool that tracks them) cannot be recovered, and the
//!   frontend's listener is the instance's address.
//!
//! Every child's [`Mailbox`] counts its queue (`mailbox_depth` in `pdserve inspect`) and
//! carries its slot's test-only [`PanicHook`].

use crate::error::RequestError;
use crate::handoff::aggregator::{
    Aggregator, AggregatorHandle, AggregatorMsg, DroppedReports, Epochs,
};
use crate::handoff::receiver::{KvReceiver, KvReceiverHandle, KvReceiverMsg};
use crate::handoff::sender::{KvSender, KvSenderHandle, KvSenderMsg};
use crate::handoff::KvContext;
use crate::http::{AppState, HttpArgs, HttpFrontend, HttpMsg};
use crate::mailbox::{Mailbox, PanicHook, Supervised};
use crate::scheduler::{Scheduler, SchedulerArgs, SchedulerConfig, SchedulerMsg};
use crate::worker::{ReportSink, StepError, TpWorker, WorkerArgs, WorkerMsg, WorkerSpec};
use pdserve_gpu::collective::ThreadCollective;
use pdserve_runtime::faults::FaultInjector;
use pdserve_runtime::supervision::{
    ActorKind, ActorSnapshot, ActorState, RestartDecision, RestartPolicy, RestartTracker,
};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Messages of the supervisor.
pub enum SupervisorMsg {
    /// Test-only fault hook: the child of this kind (one of [`ActorKind::SUPERVISED`]; for
    /// a `TpWorker`, rank `.1`) panics as it takes its next message. Answers whether there
    /// is such a child.
    InjectPanic(ActorKind, usize, RpcReplyPort<bool>),
    /// The live tree of this instance.
    Snapshot(RpcReplyPort<ActorSnapshot>),
    /// The Scheduler (for in-process clients), where the HTTP frontend listens, and its
    /// shared state.
    Handles(RpcReplyPort<Handles>),
}

/// Builds the HTTP handlers' shared state once the Scheduler (and the VisionEncoder of a
/// vision-language model) exist.
pub type AppStateFactory = Box<
    dyn FnOnce(
            Mailbox<SchedulerMsg>,
            Option<KvSenderHandle>,
            Option<crate::encode::VisionEncoderHandle>,
        ) -> Arc<AppState>
        + Send,
>;

/// Everything an instance is started from.
pub struct InstanceArgs {
    /// Instance name (prefix of its actors' registered names).
    pub name: String,
    /// What every rank is built from.
    pub worker: WorkerSpec,
    /// Scheduler limits.
    pub scheduler: SchedulerConfig,
    /// Tokenizer for the scheduler's streaming text.
    pub tokenizer: pdserve_gpu::tokenizer::Tokenizer,
    /// Builds the handlers' shared state (HTTP API and peer protocol).
    pub app: AppStateFactory,
    /// Where the HTTP frontend listens (`None`: no frontend).
    pub http: Option<SocketAddr>,
    /// Restart budget of each child.
    pub restart_policy: RestartPolicy,
    /// The KV hand-off context (instances with a transfer engine).
    pub kv: Option<Arc<KvContext>>,
    /// Per-rank epochs (shared with the KV context when there is one).
    pub epochs: Arc<Epochs>,
    /// Bound on calls between the instance's actors.
    pub call_timeout: Duration,
    /// The KV cache tiers below the block pool, if on.
    pub tiers: Option<Arc<crate::kv_tiers::KvTiers>>,
    /// A vision-language model's image encoder (`None`: a text model).
    pub encoder: Option<crate::encode::VisionEncoderArgs>,
}

/// A child's typed address: what restarting it and reading its queue need.
enum Slot {
    Worker(usize, Mailbox<WorkerMsg>),
    Scheduler(Mailbox<SchedulerMsg>),
    Aggregator(Mailbox<AggregatorMsg>),
    KvSender(Mailbox<KvSenderMsg>),
    KvReceiver(Mailbox<KvReceiverMsg>),
    Http(Mailbox<HttpMsg>),
    Encoder(Mailbox<crate::encode::actor::VisionEncoderMsg>),
}

impl Slot {
    fn kind(&self) -> ActorKind {
        match self {
            Slot::Worker(..) => ActorKind::TpWorker,
            Slot::Scheduler(_) => ActorKind::Scheduler,
            Slot::Aggregator(_) => ActorKind::Aggregator,
            Slot::KvSender(_) => ActorKind::KvSender,
            Slot::KvReceiver(_) => ActorKind::KvReceiver,
            Slot::Http(_) => ActorKind::HttpFrontend,
            Slot::Encoder(_) => ActorKind::VisionEncoder,
        }
    }

    /// The child's address, as the supervisor reads it whatever its messages.
    fn mailbox(&self) -> &dyn Supervised {
        match self {
            Slot::Worker(_, m) => m,
            Slot::Scheduler(m) => m,
            Slot::Aggregator(m) => m,
            Slot::KvSender(m) => m,
            Slot::KvReceiver(m) => m,
            Slot::Http(m) => m,
            Slot::Encoder(m) => m,
        }
    }
}

struct Child {
    name: String,
    slot: Slot,
    started: Instant,
    restarts: u32,
    last_error: Option<String>,
    tracker: RestartTracker,
}

/// The supervisor's state.
pub struct SupervisorState {
    name: String,
    scheduler: Mailbox<SchedulerMsg>,
    aggregator: Option<AggregatorHandle>,
    worker_spec: WorkerSpec,
    epochs: Arc<Epochs>,
    dropped: Arc<DroppedReports>,
    app: Option<Arc<AppState>>,
    comms: Vec<ThreadCollective>,
    /// Scheduler, KV actors and frontend first, then the workers by rank.
    children: Vec<Child>,
    kv: Option<Arc<KvContext>>,
    policy: RestartPolicy,
    started: Instant,
    addr: Option<SocketAddr>,
    /// What the VisionEncoder restarts from.
    encoder: Option<crate::encode::VisionEncoderArgs>,
}

/// The InstanceSupervisor actor (its mailbox count).
#[derive(Debug)]
pub struct InstanceSupervisor(pub crate::mailbox::Inbox);

fn worker_name(instance: &str, rank: usize) -> String {
    format!("{instance}/tp-worker-{rank}")
}

impl SupervisorState {
    fn hook(&self, kind: ActorKind) -> PanicHook {
        PanicHook::new(kind, self.faults())
    }

    fn faults(&self) -> Option<Arc<FaultInjector>> {
        self.worker_spec.faults.clone()
    }

    fn worker_args(&self, rank: usize) -> WorkerArgs {
        let mut spec = self.worker_spec.clone();
        if let Some(kv) = &self.kv {
            spec.alloc = kv.registry.allocator_for(rank);
        }
        let scheduler = self.scheduler.clone();
        let reports: ReportSink = Arc::new(move |r| {
            scheduler
                .cast(SchedulerMsg::Worker(r))
                .map_err(|_| StepError::SchedulerGone)
        });
        WorkerArgs {
            rank,
            epoch: self.epochs.worker(rank),
            spec,
            comm: self.comms[rank].clone(),
            reports,
            kv: self.kv.clone(),
        }
    }

    fn child(&self, name: String, slot: Slot) -> Child {
        Child {
            name,
            slot,
            started: Instant::now(),
            restarts: 0,
            last_error: None,
            tracker: RestartTracker::new(self.policy),
        }
    }

    /// Starts the failed child `i` again in its slot.
    async fn restart(
        &mut self,
        i: usize,
        myself: &ActorRef<SupervisorMsg>,
    ) -> Result<(), ActorProcessingErr> {
        let name = self.children[i].name.clone();
        let sup = myself.get_cell();
        let agg = || self.aggregator.clone().ok_or("no aggregator");
        let kv = || self.kv.clone().ok_or("no KV context");
        match &self.children[i].slot {
            Slot::Worker(rank, m) => {
                let rank = *rank;
                self.epochs.bump_worker(rank);
                self.epochs_moved(&[rank]);
                let args = self.worker_args(rank);
                m.respawn_linked(name, TpWorker, args, sup).await?;
            }
            Slot::Aggregator(m) => {
                let dropped = self.dropped.clone();
                m.respawn_linked(name, move |i| Aggregator(i, dropped), (), sup)
                    .await?;
            }
            Slot::KvSender(m) => {
                self.epochs.bump_incarnation();
                self.epochs_moved(&(0..self.epochs.len()).collect::<Vec<_>>());
                m.respawn_linked(name, KvSender, (kv()?, agg()?), sup)
                    .await?;
            }
            Slot::KvReceiver(m) => {
                self.epochs.bump_incarnation();
                self.epochs_moved(&(0..self.epochs.len()).collect::<Vec<_>>());
                m.respawn_linked(name, KvReceiver, (kv()?, agg()?), sup)
                    .await?;
            }
            Slot::Encoder(m) => {
                let args = self.encoder.clone().ok_or("no encoder arguments")?;
                m.respawn_linked(name, crate::encode::VisionEncoder, args, sup)
                    .await?;
            }
            Slot::Scheduler(_) | Slot::Http(_) => {
                return Err(format!("{} is not restartable", self.children[i].slot.kind()).into())
            }
        }
        let c = &mut self.children[i];
        c.started = Instant::now();
        c.restarts += 1;
        Ok(())
    }

    /// Tells the Aggregator that these ranks' hand-off epochs moved on.
    fn epochs_moved(&self, ranks: &[usize]) {
        if let Some(agg) = &self.aggregator {
            let current = self.epochs.current();
            for &rank in ranks {
                agg.epoch_bumped(rank, current[rank]);
            }
        }
    }
}

impl Actor for InstanceSupervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = InstanceArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: InstanceArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let tp = args.worker.opts.tp;
        let faults = args.worker.faults.clone();
        let hook = |kind| PanicHook::new(kind, faults.clone());
        let sup = || myself.get_cell();
        let mut slots = Vec::new();
        let dropped = args
            .kv
            .as_ref()
            .map_or_else(Arc::default, |kv| kv.dropped.clone());
        let (kv_receiver, kv_sender, aggregator) = match &args.kv {
            Some(kv) => {
                let name = format!("{}/aggregator", args.name);
                let d = dropped.clone();
                let (agg, _) = Mailbox::spawn_linked(
                    name.clone(),
                    move |i| Aggregator(i, d),
                    (),
                    sup(),
                    hook(ActorKind::Aggregator),
                )
                .await?;
                slots.push((name, Slot::Aggregator(agg.clone())));
                let agg = AggregatorHandle::new(agg);
                let name = format!("{}/kv-sender", args.name);
                let (sender, _) = Mailbox::spawn_linked(
                    name.clone(),
                    KvSender,
                    (kv.clone(), agg.clone()),
                    sup(),
                    hook(ActorKind::KvSender),
                )
                .await?;
                slots.push((name, Slot::KvSender(sender.clone())));
                let name = format!("{}/kv-receiver", args.name);
                let (receiver, _) = Mailbox::spawn_linked(
                    name.clone(),
                    KvReceiver,
                    (kv.clone(), agg.clone()),
                    sup(),
                    hook(ActorKind::KvReceiver),
                )
                .await?;
                slots.push((name, Slot::KvReceiver(receiver.clone())));
                (
                    Some(KvReceiverHandle::new(receiver)),
                    Some(KvSenderHandle::new(sender)),
                    Some(agg),
                )
            }
            None => (None, None, None),
        };
        let comms = ThreadCollective::group(tp, pdserve_gpu::tp::COLLECTIVE_TIMEOUT);
        let sched_name = format!("{}/scheduler", args.name);
        let (scheduler, _) = Mailbox::spawn_linked(
            sched_name.clone(),
            Scheduler,
            SchedulerArgs {
                config: args.scheduler,
                tokenizer: args.tokenizer,
                tp,
                collective: comms[0].clone(),
                kv_receiver,
                kv_sender: kv_sender.clone(),
                vocab_size: args.worker.config.vocab_size,
                tiers: args.tiers.clone(),
                upload_landed_kv: args.worker.device.private_kv(),
                serves_kv: !args.worker.device.private_kv()
                    || args.worker.device.mirror() == crate::worker::KvMirror::WriteThrough,
                faults: args.worker.faults.clone(),
            },
            sup(),
            hook(ActorKind::Scheduler),
        )
        .await?;
        slots.insert(0, (sched_name, Slot::Scheduler(scheduler.clone())));
        let mut st = SupervisorState {
            name: args.name.clone(),
            scheduler: scheduler.clone(),
            aggregator,
            worker_spec: args.worker,
            epochs: args.epochs,
            dropped,
            app: None,
            comms,
            children: Vec::new(),
            kv: args.kv,
            policy: args.restart_policy,
            started: Instant::now(),
            addr: None,
            encoder: args.encoder,
        };
        for (name, slot) in slots {
            let c = st.child(name, slot);
            st.children.push(c);
        }
        for rank in 0..tp {
            let name = worker_name(&st.name, rank);
            let (w, _) = Mailbox::spawn_linked(
                name.clone(),
                TpWorker,
                st.worker_args(rank),
                sup(),
                st.hook(ActorKind::TpWorker),
            )
            .await?;
            let c = st.child(name, Slot::Worker(rank, w));
            st.children.push(c);
        }
        let encoder = match st.encoder.clone() {
            Some(encoder_args) => {
                let name = format!("{}/vision-encoder", args.name);
                let (encoder, _) = Mailbox::spawn_linked(
                    name.clone(),
                    crate::encode::VisionEncoder,
                    encoder_args,
                    sup(),
                    st.hook(ActorKind::VisionEncoder),
                )
                .await?;
                let c = st.child(name, Slot::Encoder(encoder.clone()));
                st.children.insert(st.children.len() - tp, c);
                Some(crate::encode::VisionEncoderHandle::new(encoder))
            }
            None => None,
        };
        let app = (args.app)(scheduler.clone(), kv_sender, encoder);
        st.app = Some(app.clone());
        if let Some(bind) = args.http {
            let name = format!("{}/http", args.name);
            let (http, _) = Mailbox::spawn_linked(
                name.clone(),
                HttpFrontend,
                HttpArgs {
                    bind,
                    limits: app.conn_limits,
                    app,
                },
                sup(),
                st.hook(ActorKind::HttpFrontend),
            )
            .await?;
            let ms = args.call_timeout.as_millis() as u64;
            st.addr = Some(ractor::call_t!(http, HttpMsg::LocalAddr, ms)?);
            let c = st.child(name, Slot::Http(http));
            st.children.insert(st.children.len() - tp, c);
        }
        Ok(st)
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        self.0.take();
        match msg {
            SupervisorMsg::InjectPanic(kind, rank, reply) => {
                let child = st.children.iter().find(|c| match &c.slot {
                    Slot::Worker(r, _) => kind == ActorKind::TpWorker && *r == rank,
                    s => s.kind() == kind,
                });
                if let Some(c) = child {
                    c.slot.mailbox().panic_hook().arm();
                }
                let _ = reply.send(child.is_some());
            }
            SupervisorMsg::Handles(reply) => {
                if !reply.is_closed() {
                    let _ = reply.send((st.scheduler.clone(), st.addr, st.app.clone()));
                }
            }
            SupervisorMsg::Snapshot(reply) => {
                let snap = ActorSnapshot {
                    name: st.name.clone(),
                    kind: ActorKind::InstanceSupervisor.as_str().into(),
                    state: ActorState::Running,
                    restarts: 0,
                    mailbox_depth: self.0.depth(),
                    last_error: None,
                    uptime_s: st.started.elapsed().as_secs_f64(),
                    children: st.children.iter().map(snapshot_of).collect(),
                };
                if !reply.is_closed() {
                    let _ = reply.send(snap);
                }
            }
        }
        Ok(())
    }

    /// A stopping supervisor stops its children and waits for them (ractor leaves them
    /// running otherwise): their `post_stop` closes the listener, the executors end.
    async fn post_stop(
        &self,
        myself: ActorRef<Self::Msg>,
        _st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        myself
            .stop_children_and_wait(
                Some("the instance is stopping".into()),
                Some(Duration::from_secs(10)),
            )
            .await;
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<Self::Msg>,
        evt: SupervisionEvent,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let (cell, reason) = match evt {
            SupervisionEvent::ActorFailed(cell, err) => (cell, err.to_string()),
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                (cell, reason.unwrap_or_else(|| "stopped".into()))
            }
            _ => return Ok(()),
        };
        let Some(i) = st
            .children
            .iter()
            .position(|c| c.slot.mailbox().get_cell().get_id() == cell.get_id())
        else {
            return Ok(()); // an incarnation already replaced
        };
        let kind = st.children[i].slot.kind();
        metrics::counter!(pdserve_runtime::telemetry::ACTOR_RESTARTS_TOTAL, "actor" => kind.as_str())
            .increment(1);
        tracing::error!(actor = %st.children[i].name, %kind, %reason, "actor failed");
        st.children[i].last_error = Some(reason.clone());
        if matches!(st.children[i].slot, Slot::Scheduler(_) | Slot::Http(_)) {
            return Err(format!("{kind} failed: {reason}").into());
        }
        if let Slot::Worker(rank, _) = st.children[i].slot {
            let down = SchedulerMsg::WorkerDown {
                rank,
                reason: reason.clone(),
            };
            st.scheduler.tell(ActorKind::Scheduler, "worker_down", down);
        }
        match st.children[i].tracker.on_failure(Instant::now()) {
            RestartDecision::Restart { attempt } => {
                st.restart(i, &myself).await?;
                tracing::warn!(actor = %st.children[i].name, %kind, attempt, "actor restarted");
                Ok(())
            }
            RestartDecision::Escalate { restarts_in_window } => Err(format!(
                "{} failed {restarts_in_window} times within the restart window: escalating ({reason})",
                st.children[i].name
            )
            .into()),
        }
    }
}

fn snapshot_of(c: &Child) -> ActorSnapshot {
    use ractor::ActorStatus;
    let state = match c.slot.mailbox().get_cell().get_status() {
        ActorStatus::Unstarted | ActorStatus::Starting => ActorState::Starting,
        ActorStatus::Running | ActorStatus::Upgrading | ActorStatus::Draining => {
            ActorState::Running
        }
        ActorStatus::Stopping | ActorStatus::Stopped => ActorState::Stopped,
    };
    ActorSnapshot {
        name: c.name.clone(),
        kind: c.slot.kind().as_str().into(),
        state,
        restarts: c.restarts,
        mailbox_depth: c.slot.mailbox().depth(),
        last_error: c.last_error.clone(),
        uptime_s: c.started.elapsed().as_secs_f64(),
        children: Vec::new(),
    }
}

/// What `Instance::start` needs from a started tree.
pub type Handles = (
    Mailbox<SchedulerMsg>,
    Option<SocketAddr>,
    Option<Arc<AppState>>,
);

/// A typed handle on an InstanceSupervisor; every call waits at most the configured timeout.
#[derive(Clone)]
pub struct SupervisorHandle {
    mailbox: Mailbox<SupervisorMsg>,
    call_timeout: Duration,
}

impl SupervisorHandle {
    /// A handle whose calls wait at most `call_timeout`.
    pub fn new(mailbox: Mailbox<SupervisorMsg>, call_timeout: Duration) -> Self {
        Self {
            mailbox,
            call_timeout,
        }
    }

    /// The supervisor's mailbox.
    pub fn mailbox(&self) -> &Mailbox<SupervisorMsg> {
        &self.mailbox
    }

    fn ms(&self) -> u64 {
        self.call_timeout.as_millis() as u64
    }

    /// The live tree.
    ///
    /// # Errors
    /// [`RequestError::Internal`] when the supervisor is gone or does not answer in time.
    pub async fn snapshot(&self) -> Result<ActorSnapshot, RequestError> {
        ractor::call_t!(self.mailbox, SupervisorMsg::Snapshot, self.ms()).map_err(|e| {
            RequestError::Internal(format!("the instance supervisor did not answer: {e}"))
        })
    }

    /// The tree's handles.
    ///
    /// # Errors
    /// [`RequestError::Internal`] when the supervisor is gone or does not answer in time.
    pub async fn handles(&self) -> Result<Handles, RequestError> {
        ractor::call_t!(self.mailbox, SupervisorMsg::Handles, self.ms()).map_err(|e| {
            RequestError::Internal(format!("the instance supervisor did not answer: {e}"))
        })
    }

    /// Test-only fault hook: arms the panic of the child of `kind` (rank `rank` for a
    /// TpWorker); answers whether there is such a child.
    ///
    /// # Errors
    /// [`RequestError::Internal`] when the supervisor is gone or does not answer in time.
    pub async fn inject_panic(&self, kind: ActorKind, rank: usize) -> Result<bool, RequestError> {
        ractor::call_t!(
            self.mailbox,
            SupervisorMsg::InjectPanic,
            self.ms(),
            kind,
            rank
        )
        .map_err(|e| RequestError::Internal(format!("the instance supervisor did not answer: {e}")))
    }
}
