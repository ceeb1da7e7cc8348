//! The InstanceSupervisor: starts an instance's actors and keeps them alive.
//!
//! Policy, written out (one-for-one, each child under its own [`RestartPolicy`] budget,
//! default 3 in 60 s; a child that keeps failing escalates: the supervisor fails, which
//! stops the instance instead of looping — `pdserve launch` then restarts the process):
//! - a **TpWorker** is restarted with a new epoch, a fresh shard and KV region, after the
//!   Scheduler has failed the step it was running (those requests end with a 5xx, their
//!   blocks return to the pool);
//! - the **Aggregator**, **KvSender** and **KvReceiver** are restarted in place: everyone
//!   reaches them through a [`Mailbox`] the restart re-points. What a failed incarnation
//!   had open ends with it and is failed explicitly (hand-off waiters see their channel
//!   close; see each actor's docs), nothing waits for it;
//! - a failed **Scheduler** or **HttpFrontend** escalates at once: the requests the
//!   Scheduler held (and the block pool that tracks them) cannot be recovered, and the
//!   frontend's listener is the instance's address.
//!
//! Every child's [`Mailbox`] counts its queue (`mailbox_depth` in `pdserve inspect`) and
//! carries its slot's test-only [`PanicHook`].

use crate::aggregator::{Aggregator, AggregatorMsg};
use crate::http::{AppState, HttpArgs, HttpFrontend, HttpMsg};
use crate::kv_receiver::{KvContext, KvReceiver, KvReceiverMsg};
use crate::kv_sender::{KvSender, KvSenderMsg};
use crate::mailbox::{Mailbox, PanicHook};
use crate::scheduler::{Scheduler, SchedulerArgs, SchedulerConfig, SchedulerMsg, SchedulerStats};
use crate::worker::{TpWorker, WorkerArgs, WorkerMsg, WorkerSpec};
use pdserve_gpu::collective::ThreadCollective;
use pdserve_runtime::faults::FaultInjector;
use pdserve_runtime::supervision::{
    ActorSnapshot, ActorState, RestartDecision, RestartPolicy, RestartTracker,
};
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Messages of the supervisor.
pub enum SupervisorMsg {
    /// Test-only fault hook: the child of this kind (`TpWorker`, `Scheduler`, `KvSender`,
    /// `KvReceiver`, `Aggregator`, `HttpFrontend`; for `TpWorker`, rank `.1`) panics as it
    /// takes its next message. Answers whether there is such a child.
    InjectPanic(String, usize, RpcReplyPort<bool>),
    /// The live tree of this instance.
    Snapshot(RpcReplyPort<ActorSnapshot>),
    /// The Scheduler (for in-process clients) and where the HTTP frontend listens.
    Handles(RpcReplyPort<(Mailbox<SchedulerMsg>, Option<SocketAddr>)>),
}

/// Builds the HTTP handlers' shared state once the Scheduler exists.
pub type AppStateFactory =
    Box<dyn FnOnce(Mailbox<SchedulerMsg>, Option<Mailbox<KvSenderMsg>>) -> AppState + Send>;

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
    /// HTTP frontend: where to listen and the handler state (its `scheduler` field is
    /// replaced by the real one).
    pub http: Option<(SocketAddr, AppStateFactory)>,
    /// Restart budget of each child.
    pub restart_policy: RestartPolicy,
    /// The KV hand-off context (instances with a transfer engine).
    pub kv: Option<Arc<KvContext>>,
}

/// A child's typed address: what restarting it and reading its queue need.
enum Slot {
    Worker(usize, Mailbox<WorkerMsg>),
    Scheduler(Mailbox<SchedulerMsg>),
    Aggregator(Mailbox<AggregatorMsg>),
    KvSender(Mailbox<KvSenderMsg>),
    KvReceiver(Mailbox<KvReceiverMsg>),
    Http(Mailbox<HttpMsg>),
}

impl Slot {
    fn kind(&self) -> &'static str {
        match self {
            Slot::Worker(..) => "TpWorker",
            Slot::Scheduler(_) => "Scheduler",
            Slot::Aggregator(_) => "Aggregator",
            Slot::KvSender(_) => "KvSender",
            Slot::KvReceiver(_) => "KvReceiver",
            Slot::Http(_) => "HttpFrontend",
        }
    }

    fn depth(&self) -> usize {
        match self {
            Slot::Worker(_, m) => m.depth(),
            Slot::Scheduler(m) => m.depth(),
            Slot::Aggregator(m) => m.depth(),
            Slot::KvSender(m) => m.depth(),
            Slot::KvReceiver(m) => m.depth(),
            Slot::Http(m) => m.depth(),
        }
    }

    fn cell(&self) -> ActorCell {
        match self {
            Slot::Worker(_, m) => m.get_cell(),
            Slot::Scheduler(m) => m.get_cell(),
            Slot::Aggregator(m) => m.get_cell(),
            Slot::KvSender(m) => m.get_cell(),
            Slot::KvReceiver(m) => m.get_cell(),
            Slot::Http(m) => m.get_cell(),
        }
    }

    fn hook(&self) -> PanicHook {
        match self {
            Slot::Worker(_, m) => m.panic_hook(),
            Slot::Scheduler(m) => m.panic_hook(),
            Slot::Aggregator(m) => m.panic_hook(),
            Slot::KvSender(m) => m.panic_hook(),
            Slot::KvReceiver(m) => m.panic_hook(),
            Slot::Http(m) => m.panic_hook(),
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
    aggregator: Option<Mailbox<AggregatorMsg>>,
    worker_spec: WorkerSpec,
    epochs: Vec<u64>,
    comms: Vec<ThreadCollective>,
    /// Scheduler, KV actors and frontend first, then the workers by rank.
    children: Vec<Child>,
    kv: Option<Arc<KvContext>>,
    policy: RestartPolicy,
    started: Instant,
    addr: Option<SocketAddr>,
}

/// The InstanceSupervisor actor (its mailbox count).
#[derive(Debug)]
pub struct InstanceSupervisor(pub crate::mailbox::Inbox);

fn worker_name(instance: &str, rank: usize) -> String {
    format!("{instance}/tp-worker-{rank}")
}

impl SupervisorState {
    fn hook(&self, kind: &'static str) -> PanicHook {
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
        WorkerArgs {
            rank,
            epoch: self.epochs[rank],
            spec,
            comm: self.comms[rank].clone(),
            scheduler: self.scheduler.clone(),
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
        // The dead actor's registered name is released asynchronously.
        for _ in 0..100 {
            if ractor::registry::where_is(name.clone()).is_none() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let sup = myself.get_cell();
        let agg = || self.aggregator.clone().ok_or("no aggregator");
        let kv = || self.kv.clone().ok_or("no KV context");
        match &self.children[i].slot {
            Slot::Worker(rank, m) => {
                let rank = *rank;
                self.epochs[rank] += 1;
                let args = self.worker_args(rank);
                m.respawn_linked(name, TpWorker, args, sup).await?;
            }
            Slot::Aggregator(m) => {
                m.respawn_linked(name, Aggregator, (), sup).await?;
            }
            Slot::KvSender(m) => {
                m.respawn_linked(name, KvSender, (kv()?, agg()?), sup)
                    .await?;
            }
            Slot::KvReceiver(m) => {
                m.respawn_linked(name, KvReceiver, (kv()?, agg()?), sup)
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
        let (kv_receiver, kv_sender, aggregator) = match &args.kv {
            Some(kv) => {
                let name = format!("{}/aggregator", args.name);
                let (agg, _) =
                    Mailbox::spawn_linked(name.clone(), Aggregator, (), sup(), hook("Aggregator"))
                        .await?;
                slots.push((name, Slot::Aggregator(agg.clone())));
                let name = format!("{}/kv-sender", args.name);
                let (sender, _) = Mailbox::spawn_linked(
                    name.clone(),
                    KvSender,
                    (kv.clone(), agg.clone()),
                    sup(),
                    hook("KvSender"),
                )
                .await?;
                slots.push((name, Slot::KvSender(sender.clone())));
                let name = format!("{}/kv-receiver", args.name);
                let (receiver, _) = Mailbox::spawn_linked(
                    name.clone(),
                    KvReceiver,
                    (kv.clone(), agg.clone()),
                    sup(),
                    hook("KvReceiver"),
                )
                .await?;
                slots.push((name, Slot::KvReceiver(receiver.clone())));
                (Some(receiver), Some(sender), Some(agg))
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
                kv_generation: args.kv.as_ref().map(|k| k.registry.clone()),
                vocab_size: args.worker.config.vocab_size,
            },
            sup(),
            hook("Scheduler"),
        )
        .await?;
        slots.insert(0, (sched_name, Slot::Scheduler(scheduler.clone())));
        let mut st = SupervisorState {
            name: args.name.clone(),
            scheduler: scheduler.clone(),
            aggregator,
            worker_spec: args.worker,
            epochs: vec![1; tp],
            comms,
            children: Vec::new(),
            kv: args.kv,
            policy: args.restart_policy,
            started: Instant::now(),
            addr: None,
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
                st.hook("TpWorker"),
            )
            .await?;
            let c = st.child(name, Slot::Worker(rank, w));
            st.children.push(c);
        }
        if let Some((bind, make_app)) = args.http {
            let app = Arc::new(make_app(scheduler.clone(), kv_sender));
            let name = format!("{}/http", args.name);
            let (http, _) = Mailbox::spawn_linked(
                name.clone(),
                HttpFrontend,
                HttpArgs { bind, app },
                sup(),
                st.hook("HttpFrontend"),
            )
            .await?;
            st.addr = Some(ractor::call_t!(http, HttpMsg::LocalAddr, 5_000)?);
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
                    Slot::Worker(r, _) => kind == "TpWorker" && *r == rank,
                    s => s.kind() == kind,
                });
                if let Some(c) = child {
                    c.slot.hook().arm();
                }
                let _ = reply.send(child.is_some());
            }
            SupervisorMsg::Handles(reply) => {
                if !reply.is_closed() {
                    let _ = reply.send((st.scheduler.clone(), st.addr));
                }
            }
            SupervisorMsg::Snapshot(reply) => {
                let snap = ActorSnapshot {
                    name: st.name.clone(),
                    kind: "InstanceSupervisor".into(),
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
            .position(|c| c.slot.cell().get_id() == cell.get_id())
        else {
            return Ok(()); // an incarnation already replaced
        };
        let kind = st.children[i].slot.kind();
        metrics::counter!(pdserve_runtime::telemetry::ACTOR_RESTARTS_TOTAL, "actor" => kind)
            .increment(1);
        tracing::error!(actor = %st.children[i].name, kind, %reason, "actor failed");
        st.children[i].last_error = Some(reason.clone());
        if matches!(st.children[i].slot, Slot::Scheduler(_) | Slot::Http(_)) {
            return Err(format!("{kind} failed: {reason}").into());
        }
        if let Slot::Worker(rank, _) = st.children[i].slot {
            let _ = st.scheduler.cast(SchedulerMsg::WorkerDown {
                rank,
                reason: reason.clone(),
            });
        }
        match st.children[i].tracker.on_failure(Instant::now()) {
            RestartDecision::Restart { attempt } => {
                st.restart(i, &myself).await?;
                tracing::warn!(actor = %st.children[i].name, kind, attempt, "actor restarted");
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
    let state = match c.slot.cell().get_status() {
        ActorStatus::Unstarted | ActorStatus::Starting => ActorState::Starting,
        ActorStatus::Running | ActorStatus::Upgrading | ActorStatus::Draining => {
            ActorState::Running
        }
        ActorStatus::Stopping | ActorStatus::Stopped => ActorState::Stopped,
    };
    ActorSnapshot {
        name: c.name.clone(),
        kind: c.slot.kind().into(),
        state,
        restarts: c.restarts,
        mailbox_depth: c.slot.depth(),
        last_error: c.last_error.clone(),
        uptime_s: c.started.elapsed().as_secs_f64(),
        children: Vec::new(),
    }
}

/// Queries the scheduler (bounded wait).
///
/// # Errors
/// When the scheduler is gone or does not answer in time.
pub async fn scheduler_stats(
    scheduler: &Mailbox<SchedulerMsg>,
) -> Result<SchedulerStats, ActorProcessingErr> {
    Ok(ractor::call_t!(scheduler, SchedulerMsg::Stats, 5_000)?)
}
