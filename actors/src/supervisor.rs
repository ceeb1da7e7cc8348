//! The InstanceSupervisor: starts an instance's Scheduler, TpWorkers and HttpFrontend, and
//! keeps them alive.
//!
//! Policy, written out: a TpWorker that fails is restarted with a new epoch, a fresh shard
//! and KV region, after the Scheduler has failed the step it was running (those requests end
//! with a 5xx, their blocks return to the pool). Restarts are counted per rank under a
//! [`RestartPolicy`] (default 3 in 60 s); a rank that keeps crashing escalates: the supervisor
//! fails, which stops the instance instead of looping. A failed Scheduler or HttpFrontend
//! escalates at once (the requests the Scheduler held cannot be recovered).

use crate::http::{AppState, HttpArgs, HttpFrontend, HttpMsg};
use crate::scheduler::{Scheduler, SchedulerArgs, SchedulerConfig, SchedulerMsg, SchedulerStats};
use crate::worker::{TpWorker, WorkerArgs, WorkerSpec};
use pdserve_gpu::collective::ThreadCollective;
use pdserve_runtime::supervision::{
    ActorSnapshot, ActorState, RestartDecision, RestartPolicy, RestartTracker,
};
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Messages of the supervisor.
pub enum SupervisorMsg {
    /// Test-only fault hook: make rank `0`'s worker panic on its next step.
    InjectWorkerPanic(usize),
    /// The live tree of this instance.
    Snapshot(RpcReplyPort<ActorSnapshot>),
    /// The Scheduler (for in-process clients) and where the HTTP frontend listens.
    Handles(RpcReplyPort<(ActorRef<SchedulerMsg>, Option<SocketAddr>)>),
}

/// Builds the HTTP handlers' shared state once the Scheduler exists.
pub type AppStateFactory = Box<
    dyn FnOnce(ActorRef<SchedulerMsg>, Option<ActorRef<crate::kv_sender::KvSenderMsg>>) -> AppState
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
    /// HTTP frontend: where to listen and the handler state (its `scheduler` field is
    /// replaced by the real one).
    pub http: Option<(SocketAddr, AppStateFactory)>,
    /// Worker restart budget.
    pub restart_policy: RestartPolicy,
    /// The KV hand-off context (instances with a transfer engine).
    pub kv: Option<Arc<crate::kv_receiver::KvContext>>,
}

struct Child {
    name: String,
    kind: &'static str,
    cell: ActorCell,
    started: Instant,
    restarts: u32,
    last_error: Option<String>,
}

/// The supervisor's state.
pub struct SupervisorState {
    name: String,
    scheduler: ActorRef<SchedulerMsg>,
    worker_spec: WorkerSpec,
    workers: Vec<Child>,
    epochs: Vec<u64>,
    trackers: Vec<RestartTracker>,
    comms: Vec<ThreadCollective>,
    panic_flags: Vec<Arc<AtomicBool>>,
    others: Vec<Child>,
    kv: Option<Arc<crate::kv_receiver::KvContext>>,
    started: Instant,
    addr: Option<SocketAddr>,
}

/// The InstanceSupervisor actor.
#[derive(Debug)]
pub struct InstanceSupervisor;

fn worker_name(instance: &str, rank: usize) -> String {
    format!("{instance}/tp-worker-{rank}")
}

async fn spawn_worker(
    st: &SupervisorState,
    rank: usize,
    myself: &ActorRef<SupervisorMsg>,
) -> Result<Child, ActorProcessingErr> {
    let mut spec = st.worker_spec.clone();
    if let Some(kv) = &st.kv {
        spec.alloc = kv.registry.allocator_for(rank);
    }
    let args = WorkerArgs {
        rank,
        epoch: st.epochs[rank],
        spec,
        comm: st.comms[rank].clone(),
        scheduler: st.scheduler.clone(),
        panic_next: st.panic_flags[rank].clone(),
    };
    let name = worker_name(&st.name, rank);
    let (w, _) = Actor::spawn_linked(Some(name.clone()), TpWorker, args, myself.get_cell()).await?;
    Ok(Child {
        name,
        kind: "TpWorker",
        cell: w.get_cell(),
        started: Instant::now(),
        restarts: 0,
        last_error: None,
    })
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
        let comms = ThreadCollective::group(tp, pdserve_gpu::tp::COLLECTIVE_TIMEOUT);
        let mut others = Vec::new();
        let (kv_receiver, kv_sender) = match &args.kv {
            Some(kv) => {
                let child = |name: String, kind: &'static str, cell: ActorCell| Child {
                    name,
                    kind,
                    cell,
                    started: Instant::now(),
                    restarts: 0,
                    last_error: None,
                };
                let name = format!("{}/aggregator", args.name);
                let (agg, _) = Actor::spawn_linked(
                    Some(name.clone()),
                    crate::aggregator::Aggregator,
                    (),
                    myself.get_cell(),
                )
                .await?;
                others.push(child(name, "Aggregator", agg.get_cell()));
                let name = format!("{}/kv-sender", args.name);
                let (sender, _) = Actor::spawn_linked(
                    Some(name.clone()),
                    crate::kv_sender::KvSender,
                    (kv.clone(), agg.clone()),
                    myself.get_cell(),
                )
                .await?;
                others.push(child(name, "KvSender", sender.get_cell()));
                let name = format!("{}/kv-receiver", args.name);
                let (receiver, _) = Actor::spawn_linked(
                    Some(name.clone()),
                    crate::kv_receiver::KvReceiver,
                    (kv.clone(), agg),
                    myself.get_cell(),
                )
                .await?;
                others.push(child(name, "KvReceiver", receiver.get_cell()));
                (Some(receiver), Some(sender))
            }
            None => (None, None),
        };
        let sched_name = format!("{}/scheduler", args.name);
        let (scheduler, _) = Actor::spawn_linked(
            Some(sched_name.clone()),
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
            myself.get_cell(),
        )
        .await?;
        others.insert(
            0,
            Child {
                name: sched_name,
                kind: "Scheduler",
                cell: scheduler.get_cell(),
                started: Instant::now(),
                restarts: 0,
                last_error: None,
            },
        );
        let mut st = SupervisorState {
            name: args.name.clone(),
            scheduler: scheduler.clone(),
            worker_spec: args.worker,
            workers: Vec::new(),
            epochs: vec![1; tp],
            trackers: (0..tp)
                .map(|_| RestartTracker::new(args.restart_policy))
                .collect(),
            comms,
            panic_flags: (0..tp).map(|_| Arc::new(AtomicBool::new(false))).collect(),
            others,
            kv: args.kv,
            started: Instant::now(),
            addr: None,
        };
        for rank in 0..tp {
            let child = spawn_worker(&st, rank, &myself).await?;
            st.workers.push(child);
        }
        if let Some((bind, make_app)) = args.http {
            let app = Arc::new(make_app(scheduler.clone(), kv_sender));
            let name = format!("{}/http", args.name);
            let (http, _) = Actor::spawn_linked(
                Some(name.clone()),
                HttpFrontend,
                HttpArgs { bind, app },
                myself.get_cell(),
            )
            .await?;
            st.addr = Some(ractor::call_t!(http, HttpMsg::LocalAddr, 5_000)?);
            st.others.push(Child {
                name,
                kind: "HttpFrontend",
                cell: http.get_cell(),
                started: Instant::now(),
                restarts: 0,
                last_error: None,
            });
        }
        Ok(st)
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SupervisorMsg::InjectWorkerPanic(rank) => {
                if let Some(flag) = st.panic_flags.get(rank) {
                    flag.store(true, std::sync::atomic::Ordering::SeqCst);
                }
            }
            SupervisorMsg::Handles(reply) => {
                if !reply.is_closed() {
                    let _ = reply.send((st.scheduler.clone(), st.addr));
                }
            }
            SupervisorMsg::Snapshot(reply) => {
                let children = st
                    .others
                    .iter()
                    .chain(&st.workers)
                    .map(snapshot_of)
                    .collect();
                let snap = ActorSnapshot {
                    name: st.name.clone(),
                    kind: "InstanceSupervisor".into(),
                    state: ActorState::Running,
                    restarts: 0,
                    mailbox_depth: 0,
                    last_error: None,
                    uptime_s: st.started.elapsed().as_secs_f64(),
                    children,
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
        if let Some(rank) = st
            .workers
            .iter()
            .position(|w| w.cell.get_id() == cell.get_id())
        {
            metrics::counter!(pdserve_runtime::telemetry::ACTOR_RESTARTS_TOTAL, "actor" => "TpWorker").increment(1);
            tracing::error!(rank, %reason, "TP worker failed");
            let _ = st.scheduler.cast(SchedulerMsg::WorkerDown {
                rank,
                reason: reason.clone(),
            });
            match st.trackers[rank].on_failure(Instant::now()) {
                RestartDecision::Restart { attempt } => {
                    st.epochs[rank] += 1;
                    // The dead worker's registered name is released asynchronously.
                    let name = worker_name(&st.name, rank);
                    for _ in 0..100 {
                        if ractor::registry::where_is(name.clone()).is_none() {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    let mut child = spawn_worker(st, rank, &myself).await?;
                    child.restarts = st.workers[rank].restarts + 1;
                    child.last_error = Some(reason);
                    st.workers[rank] = child;
                    tracing::warn!(
                        rank,
                        attempt,
                        epoch = st.epochs[rank],
                        "TP worker restarted"
                    );
                }
                RestartDecision::Escalate { restarts_in_window } => {
                    return Err(format!("TP worker {rank} failed {restarts_in_window} times within the restart window: escalating ({reason})").into());
                }
            }
            return Ok(());
        }
        if let Some(child) = st.others.iter().find(|c| c.cell.get_id() == cell.get_id()) {
            return Err(format!("{} failed: {reason}", child.kind).into());
        }
        Ok(())
    }
}

fn snapshot_of(c: &Child) -> ActorSnapshot {
    use ractor::ActorStatus;
    let state = match c.cell.get_status() {
        ActorStatus::Unstarted | ActorStatus::Starting => ActorState::Starting,
        ActorStatus::Running | ActorStatus::Upgrading | ActorStatus::Draining => {
            ActorState::Running
        }
        ActorStatus::Stopping | ActorStatus::Stopped => ActorState::Stopped,
    };
    ActorSnapshot {
        name: c.name.clone(),
        kind: c.kind.into(),
        state,
        restarts: c.restarts,
        mailbox_depth: 0,
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
    scheduler: &ActorRef<SchedulerMsg>,
) -> Result<SchedulerStats, ActorProcessingErr> {
    Ok(ractor::call_t!(scheduler, SchedulerMsg::Stats, 5_000)?)
}
