//! The simulator's event loop: instances, requests and windows (the model is described in
//! the parent module's doc).

use super::stats::{quantile, LogHistogram};
use super::{Judge, SimConfig, SimError, SimReport, Trace, WindowReport};
use crate::planner::{EngineCurves, EngineSample, Planner, PlannerMode, Split, WindowObservation};
use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, HashMap, VecDeque};

/// Most windows one run may have (115 days of 10 s windows; ~200 bytes each in memory).
const MAX_WINDOWS: usize = 1_000_000;

/// Sessions used within this many seconds count as held when choosing what to drain.
const SESSION_RECENT_S: f64 = 120.0;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Prefill,
    Decode,
}

#[derive(Debug, Clone, Copy)]
enum Ev {
    Arrival(usize),
    PrefillDone(usize),
    HandoffDone { req: usize, inst: usize },
    DecodeStep(usize),
    Ready(usize),
    Window(usize),
}

#[derive(Debug)]
struct Event {
    t: f64,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Event {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Event {}
impl PartialOrd for Event {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Event {
    /// Earliest first in a max-heap: reversed on (time, insertion order).
    fn cmp(&self, o: &Self) -> Ordering {
        o.t.total_cmp(&self.t).then(o.seq.cmp(&self.seq))
    }
}

#[derive(Debug, Clone, Copy)]
struct Req {
    arrival: f64,
    isl: u32,
    osl: u32,
    session: Option<u64>,
    prefix: u32,
    window: usize,
    /// Prompt tokens the chosen prefill instance had cached.
    cached: f64,
    /// Seconds of prefill compute.
    service: f64,
}

#[derive(Debug)]
struct Inst {
    role: Role,
    started: f64,
    ready: bool,
    draining: bool,
    gone: Option<f64>,
    sample: EngineSample,
    /// Step times of the window (their p90 goes into the sample).
    steps: LogHistogram,
    // Prefill.
    queue: VecDeque<usize>,
    queued_work: f64,
    busy_until: f64,
    current: Option<usize>,
    // Decode.
    waiting: VecDeque<usize>,
    inbound: usize,
    running: usize,
    ctx: f64,
    reserved: f64,
    finish: BinaryHeap<Reverse<(u64, usize)>>,
    step_no: u64,
    stepping: bool,
    step: (f64, u32, f64),
}

impl Inst {
    fn new(role: Role, started: f64, ready: bool) -> Self {
        Self {
            role,
            started,
            ready,
            draining: false,
            gone: None,
            sample: EngineSample::default(),
            steps: LogHistogram::default(),
            queue: VecDeque::new(),
            queued_work: 0.0,
            busy_until: 0.0,
            current: None,
            waiting: VecDeque::new(),
            inbound: 0,
            running: 0,
            ctx: 0.0,
            reserved: 0.0,
            finish: BinaryHeap::new(),
            step_no: 0,
            stepping: false,
            step: (0.0, 0, 0.0),
        }
    }

    fn active(&self) -> bool {
        !self.draining && self.gone.is_none()
    }

    fn serving(&self) -> bool {
        self.ready && self.active()
    }

    fn idle(&self) -> bool {
        match self.role {
            Role::Prefill => self.current.is_none() && self.queue.is_empty(),
            Role::Decode => {
                !self.stepping && self.running == 0 && self.waiting.is_empty() && self.inbound == 0
            }
        }
    }

    fn load(&self, now: f64) -> f64 {
        match self.role {
            Role::Prefill => self.queued_work + (self.busy_until - now).max(0.0),
            Role::Decode => (self.running + self.waiting.len() + self.inbound) as f64,
        }
    }
}

#[derive(Debug, Default)]
struct WindowAcc {
    arrivals: u64,
    isls: Vec<f64>,
    osl_done: f64,
    done: u64,
    prompt_tokens: f64,
    hit_tokens: f64,
    ttft: Vec<f64>,
    pending: usize,
    itl: LogHistogram,
    split: Split,
    reason: String,
    /// Known to miss (final once `pending` is 0 and the window has ended).
    missed: bool,
}

struct Sim<'a> {
    curves: &'a EngineCurves,
    cfg: &'a SimConfig,
    startup: f64,
    reqs: Vec<Req>,
    insts: Vec<Inst>,
    heap: BinaryHeap<Event>,
    seq: u64,
    windows: Vec<WindowAcc>,
    /// Where each session's prefix is cached, and when it was last used.
    session_at: HashMap<u64, (usize, f64)>,
    pending_prefill: VecDeque<usize>,
    pending_decode: VecDeque<usize>,
    ttft_all: Vec<f64>,
    itl_all: LogHistogram,
    completed: u64,
    prompt_tokens: f64,
    hit_tokens: f64,
    peak: Split,
    rr: usize,
}

impl Sim<'_> {
    fn push(&mut self, t: f64, ev: Ev) {
        self.seq += 1;
        self.heap.push(Event {
            t,
            seq: self.seq,
            ev,
        });
    }

    fn window_of(&self, t: f64) -> Option<usize> {
        let k = (t / self.cfg.window_s).floor();
        (k >= 0.0 && (k as usize) < self.windows.len()).then_some(k as usize)
    }

    fn count(&self, role: Role, f: impl Fn(&Inst) -> bool) -> usize {
        self.insts.iter().filter(|i| i.role == role && f(i)).count()
    }

    fn route_prefill(&mut self, now: f64, r: usize) {
        let req = self.reqs[r];
        let holder = req
            .session
            .and_then(|s| self.session_at.get(&s).map(|h| h.0));
        let mut best: Option<(f64, usize, f64, f64)> = None;
        // Equal costs go round-robin (as the proxy's router does): scan from a rotating start.
        self.rr = self.rr.wrapping_add(1);
        let n = self.insts.len();
        for k in 0..n {
            let id = (self.rr + k) % n;
            let inst = &self.insts[id];
            if inst.role != Role::Prefill || !inst.serving() {
                continue;
            }
            let cached = if holder == Some(id) {
                f64::from(req.prefix)
            } else {
                0.0
            };
            let s = self.curves.prefill_s(f64::from(req.isl), cached);
            let cost = inst.load(now) + s;
            if best.is_none_or(|b| cost < b.0) {
                best = Some((cost, id, cached, s));
            }
        }
        let Some((_, id, cached, s)) = best else {
            self.pending_prefill.push_back(r);
            return;
        };
        self.reqs[r].cached = cached;
        self.reqs[r].service = s;
        let inst = &mut self.insts[id];
        inst.queue.push_back(r);
        inst.queued_work += s;
        if inst.current.is_none() {
            self.start_prefill(now, id);
        }
    }

    fn start_prefill(&mut self, now: f64, id: usize) {
        let Some(r) = self.insts[id].queue.pop_front() else {
            return;
        };
        let req = self.reqs[r];
        let inst = &mut self.insts[id];
        inst.queued_work = (inst.queued_work - req.service).max(0.0);
        inst.current = Some(r);
        inst.busy_until = now + req.service;
        self.prompt_tokens += f64::from(req.isl);
        self.hit_tokens += req.cached;
        if let Some(w) = self.window_of(now) {
            self.windows[w].prompt_tokens += f64::from(req.isl);
            self.windows[w].hit_tokens += req.cached;
        }
        self.push(now + req.service, Ev::PrefillDone(id));
    }

    fn pick_decode(&mut self) -> Option<usize> {
        let mut best: Option<(f64, usize)> = None;
        self.rr = self.rr.wrapping_add(1);
        let n = self.insts.len();
        for k in 0..n {
            let id = (self.rr + k) % n;
            let inst = &self.insts[id];
            if inst.role == Role::Decode && inst.serving() {
                let l = inst.load(0.0);
                if best.is_none_or(|b| l < b.0) {
                    best = Some((l, id));
                }
            }
        }
        best.map(|b| b.1)
    }

    fn hand_off(&mut self, now: f64, r: usize) {
        match self.pick_decode() {
            Some(d) => {
                self.insts[d].inbound += 1;
                let t = now + self.curves.handoff_tokens_s(f64::from(self.reqs[r].isl));
                self.push(t, Ev::HandoffDone { req: r, inst: d });
            }
            None => self.pending_decode.push_back(r),
        }
    }

    fn prefill_done(&mut self, now: f64, id: usize) {
        let Some(r) = self.insts[id].current.take() else {
            return;
        };
        let req = self.reqs[r];
        let inst = &mut self.insts[id];
        inst.sample.steps += 1;
        inst.sample.busy_s += req.service;
        inst.steps.add(req.service, 1);
        inst.sample.batch_tokens += f64::from(req.isl) - req.cached;
        if let Some(s) = req.session {
            self.session_at.insert(s, (id, now));
        }
        self.hand_off(now, r);
        if self.insts[id].queue.is_empty() {
            if self.insts[id].draining {
                self.insts[id].gone = Some(now);
            }
        } else {
            self.start_prefill(now, id);
        }
    }

    fn complete(&mut self, now: f64, r: usize) {
        self.completed += 1;
        if let Some(w) = self.window_of(now) {
            self.windows[w].done += 1;
            self.windows[w].osl_done += f64::from(self.reqs[r].osl);
        }
    }

    fn admit(&mut self, now: f64, id: usize) {
        let max_batch = self.curves.limits.max_batch as usize;
        let cap = self.curves.limits.kv_capacity_tokens as f64;
        while let Some(&r) = self.insts[id].waiting.front() {
            let req = self.reqs[r];
            let need = f64::from(req.isl) + f64::from(req.osl);
            let inst = &mut self.insts[id];
            let fits = inst.running == 0 || inst.reserved + need <= cap;
            if inst.running >= max_batch || !fits {
                break;
            }
            inst.waiting.pop_front();
            let ttft = now - req.arrival;
            self.ttft_all.push(ttft);
            let w = &mut self.windows[req.window];
            w.ttft.push(ttft);
            w.pending -= 1;
            if req.osl <= 1 {
                self.complete(now, r);
                continue;
            }
            let inst = &mut self.insts[id];
            inst.running += 1;
            inst.reserved += need;
            inst.ctx += f64::from(req.isl);
            inst.finish
                .push(Reverse((inst.step_no + u64::from(req.osl) - 1, r)));
        }
    }

    fn start_step(&mut self, now: f64, id: usize) {
        let inst = &mut self.insts[id];
        let batch = inst.running as u32;
        let dur = self.curves.decode_step_s(batch, inst.ctx).max(1e-6);
        inst.step = (dur, batch, inst.ctx);
        inst.stepping = true;
        self.push(now + dur, Ev::DecodeStep(id));
    }

    fn decode_step(&mut self, now: f64, id: usize) {
        let (dur, batch, ctx) = self.insts[id].step;
        if let Some(w) = self.window_of(now) {
            self.windows[w].itl.add(dur, u64::from(batch));
        }
        self.itl_all.add(dur, u64::from(batch));
        let mut done = Vec::new();
        {
            let inst = &mut self.insts[id];
            inst.step_no += 1;
            inst.sample.steps += 1;
            inst.sample.busy_s += dur;
            inst.steps.add(dur, 1);
            inst.sample.batch_tokens += f64::from(batch);
            inst.sample.context_tokens += ctx;
            inst.ctx += f64::from(batch);
            while let Some(&Reverse((step, r))) = inst.finish.peek() {
                if step > inst.step_no {
                    break;
                }
                inst.finish.pop();
                done.push(r);
            }
        }
        for r in done {
            let req = self.reqs[r];
            let inst = &mut self.insts[id];
            inst.running -= 1;
            inst.reserved -= f64::from(req.isl) + f64::from(req.osl);
            inst.ctx -= f64::from(req.isl) + f64::from(req.osl - 1);
            self.complete(now, r);
        }
        self.admit(now, id);
        if self.insts[id].running > 0 {
            self.start_step(now, id);
        } else {
            let inst = &mut self.insts[id];
            inst.stepping = false;
            inst.ctx = 0.0;
            inst.reserved = 0.0;
            if inst.draining && inst.idle() {
                inst.gone = Some(now);
            }
        }
    }

    fn handoff_done(&mut self, now: f64, r: usize, id: usize) {
        let inst = &mut self.insts[id];
        inst.inbound -= 1;
        inst.waiting.push_back(r);
        if !inst.stepping {
            self.admit(now, id);
            if self.insts[id].running > 0 {
                self.start_step(now, id);
            } else if self.insts[id].draining && self.insts[id].idle() {
                self.insts[id].gone = Some(now);
            }
        }
    }

    fn ready(&mut self, now: f64, id: usize) {
        if self.insts[id].gone.is_some() {
            return;
        }
        self.insts[id].ready = true;
        match self.insts[id].role {
            Role::Prefill => {
                for r in std::mem::take(&mut self.pending_prefill) {
                    self.route_prefill(now, r);
                }
            }
            Role::Decode => {
                for r in std::mem::take(&mut self.pending_decode) {
                    self.hand_off(now, r);
                }
            }
        }
    }

    fn start_instance(&mut self, now: f64, role: Role) {
        self.insts.push(Inst::new(role, now, false));
        let id = self.insts.len() - 1;
        self.push(now + self.startup, Ev::Ready(id));
    }

    /// Brings `role` to `want` active instances: starts new ones, or drains (cancels starting
    /// ones first, then the least loaded).
    fn apply(&mut self, now: f64, role: Role, want: usize) {
        let active: Vec<usize> = (0..self.insts.len())
            .filter(|&i| self.insts[i].role == role && self.insts[i].active())
            .collect();
        if want > active.len() {
            for _ in active.len()..want {
                self.start_instance(now, role);
            }
            return;
        }
        let mut victims = active;
        // Sessions each prefill instance served in the last two minutes: draining one loses
        // its prefix cache, so the one holding the fewest goes first.
        let mut sessions = vec![0usize; self.insts.len()];
        if role == Role::Prefill {
            for &(id, at) in self.session_at.values() {
                if now - at < SESSION_RECENT_S {
                    sessions[id] += 1;
                }
            }
        }
        // Starting ones first (newest first), then by sessions held, then by load.
        victims.sort_by(|&a, &b| {
            let (x, y) = (&self.insts[a], &self.insts[b]);
            x.ready
                .cmp(&y.ready)
                .then(sessions[a].cmp(&sessions[b]))
                .then(x.load(now).total_cmp(&y.load(now)))
                .then(b.cmp(&a))
        });
        let n = victims.len() - want;
        for &v in victims.iter().take(n) {
            let inst = &mut self.insts[v];
            if !inst.ready {
                inst.gone = Some(now);
            } else {
                inst.draining = true;
                if inst.idle() {
                    inst.gone = Some(now);
                }
            }
        }
    }

    fn active_split(&self) -> (Split, Split) {
        let cur = Split::new(
            self.count(Role::Prefill, Inst::active),
            self.count(Role::Decode, Inst::active),
        );
        let starting = Split::new(
            self.count(Role::Prefill, |i| i.active() && !i.ready),
            self.count(Role::Decode, |i| i.active() && !i.ready),
        );
        (cur, starting)
    }

    fn observation(&mut self, k: usize) -> WindowObservation {
        let w = &self.windows[k];
        let mut isls = w.isls.clone();
        let (current, starting) = self.active_split();
        let mut obs = WindowObservation {
            duration_s: self.cfg.window_s,
            arrivals: w.arrivals,
            mean_isl: if isls.is_empty() {
                0.0
            } else {
                isls.iter().sum::<f64>() / isls.len() as f64
            },
            p90_isl: quantile(&mut isls, 0.9).unwrap_or(0.0),
            mean_osl: if w.done > 0 {
                w.osl_done / w.done as f64
            } else {
                0.0
            },
            prefix_hit_rate: if w.prompt_tokens > 0.0 {
                w.hit_tokens / w.prompt_tokens
            } else {
                0.0
            },
            current,
            starting,
            ..Default::default()
        };
        for inst in &mut self.insts {
            let mut s = std::mem::take(&mut inst.sample);
            let steps = std::mem::take(&mut inst.steps);
            s.p90_step_s = steps.quantile(0.9).unwrap_or(0.0);
            if !inst.serving() {
                continue;
            }
            match inst.role {
                Role::Prefill => {
                    s.waiting = inst.queue.len();
                    s.waiting_tokens = inst
                        .queue
                        .iter()
                        .map(|&r| f64::from(self.reqs[r].isl) - self.reqs[r].cached)
                        .sum();
                    obs.prefill.push(s);
                }
                Role::Decode => {
                    s.waiting = inst.waiting.len() + inst.inbound;
                    s.running = inst.running;
                    obs.decode.push(s);
                }
            }
        }
        obs
    }

    /// Whether window `j` is known to miss at `now` (its ITL is final once it ended; a
    /// request still without a first token counts with the time it has waited so far, a
    /// lower bound of its TTFT).
    fn known_miss(&self, j: usize, now: f64) -> bool {
        let w = &self.windows[j];
        let sla = self.cfg.sla;
        let itl_miss = w.itl.quantile(0.9).is_some_and(|v| v > sla.itl_s);
        let lb = (now - (j as f64 + 1.0) * self.cfg.window_s).max(0.0);
        let mut v = w.ttft.clone();
        v.extend(std::iter::repeat_n(lb, w.pending));
        let ttft_miss = quantile(&mut v, 0.9).is_some_and(|p| p > sla.ttft_s);
        match self.cfg.judge {
            Judge::Both => itl_miss || ttft_miss,
            Judge::Ttft => ttft_miss,
            Judge::Itl => itl_miss,
        }
    }
}

pub(super) fn run(
    trace: &Trace,
    curves: &EngineCurves,
    cfg: &SimConfig,
) -> Result<SimReport, SimError> {
    if !(cfg.window_s.is_finite() && cfg.window_s > 0.0) {
        return Err(SimError::Config("window_s must be > 0".into()));
    }
    let startup = cfg.startup_s.unwrap_or(curves.limits.startup_s);
    if !(startup.is_finite() && startup >= 0.0) {
        return Err(SimError::Config("startup_s must be >= 0".into()));
    }
    let n_windows = (trace.last_arrival_s() / cfg.window_s).floor() + 1.0;
    if n_windows > MAX_WINDOWS as f64 {
        return Err(SimError::Config(format!(
            "the trace spans {n_windows} windows of {} s; at most {MAX_WINDOWS}",
            cfg.window_s
        )));
    }
    let n_windows = n_windows as usize;
    let reqs: Vec<Req> = trace
        .requests()
        .iter()
        .map(|r| Req {
            arrival: r.t,
            isl: r.isl,
            osl: r.osl,
            session: r.session,
            prefix: r.prefix,
            window: ((r.t / cfg.window_s).floor() as usize).min(n_windows - 1),
            cached: 0.0,
            service: 0.0,
        })
        .collect();
    let mut planner = match &cfg.planner {
        Some(p) => {
            let pc = crate::planner::PlannerConfig {
                window_s: cfg.window_s,
                startup_s: startup,
                sla: cfg.sla,
                ..p.clone()
            };
            Some(Planner::new(pc, Some(curves.clone()))?)
        }
        None => None,
    };
    let mut windows: Vec<WindowAcc> = (0..n_windows).map(|_| WindowAcc::default()).collect();
    for r in &reqs {
        let w = &mut windows[r.window];
        w.arrivals += 1;
        w.pending += 1;
        w.isls.push(f64::from(r.isl));
    }
    let initial = match (cfg.initial, &cfg.planner) {
        (Some(s), _) => s,
        (None, Some(p)) => {
            // What throughput mode plans for the first window's requests.
            let pc = crate::planner::PlannerConfig {
                mode: PlannerMode::Throughput,
                window_s: cfg.window_s,
                startup_s: startup,
                sla: cfg.sla,
                ..p.clone()
            };
            let mut first = Planner::new(pc, Some(curves.clone()))?;
            let w = &windows[0];
            let mut isls = w.isls.clone();
            let first_osl: Vec<f64> = reqs
                .iter()
                .filter(|r| r.window == 0)
                .map(|r| f64::from(r.osl))
                .collect();
            let obs = WindowObservation {
                duration_s: cfg.window_s,
                arrivals: w.arrivals,
                mean_isl: isls.iter().sum::<f64>() / isls.len().max(1) as f64,
                p90_isl: quantile(&mut isls, 0.9).unwrap_or(0.0),
                mean_osl: first_osl.iter().sum::<f64>() / first_osl.len().max(1) as f64,
                ..Default::default()
            };
            first.observe(&obs).split
        }
        (None, None) => Split::new(1, 1),
    };
    if initial.prefill == 0 || initial.decode == 0 {
        return Err(SimError::Config(
            "the initial split needs at least one instance of each role".into(),
        ));
    }
    let mut sim = Sim {
        curves,
        cfg,
        startup,
        reqs,
        insts: Vec::new(),
        heap: BinaryHeap::new(),
        seq: 0,
        windows,
        session_at: HashMap::new(),
        pending_prefill: VecDeque::new(),
        pending_decode: VecDeque::new(),
        ttft_all: Vec::new(),
        itl_all: LogHistogram::default(),
        completed: 0,
        prompt_tokens: 0.0,
        hit_tokens: 0.0,
        peak: initial,
        rr: 0,
    };
    for _ in 0..initial.prefill {
        sim.insts.push(Inst::new(Role::Prefill, 0.0, true));
    }
    for _ in 0..initial.decode {
        sim.insts.push(Inst::new(Role::Decode, 0.0, true));
    }
    sim.push(sim.reqs[0].arrival, Ev::Arrival(0));
    sim.push(cfg.window_s, Ev::Window(0));
    let mut events = 0u64;
    let mut gave_up = false;
    let mut open = 0usize;
    while let Some(e) = sim.heap.pop() {
        events += 1;
        if events > cfg.max_events {
            return Err(SimError::TooManyEvents(cfg.max_events));
        }
        let now = e.t;
        match e.ev {
            Ev::Arrival(r) => {
                sim.route_prefill(now, r);
                if r + 1 < sim.reqs.len() {
                    let t = sim.reqs[r + 1].arrival;
                    sim.push(t, Ev::Arrival(r + 1));
                }
            }
            Ev::PrefillDone(id) => sim.prefill_done(now, id),
            Ev::HandoffDone { req, inst } => sim.handoff_done(now, req, inst),
            Ev::DecodeStep(id) => sim.decode_step(now, id),
            Ev::Ready(id) => sim.ready(now, id),
            Ev::Window(k) => {
                let obs = sim.observation(k);
                if let Some(p) = planner.as_mut() {
                    let d = p.observe(&obs);
                    sim.apply(now, Role::Prefill, d.split.prefill);
                    sim.apply(now, Role::Decode, d.split.decode);
                    sim.windows[k].reason = d.reason;
                }
                let (cur, _) = sim.active_split();
                sim.windows[k].split = cur;
                sim.peak = Split::new(
                    sim.peak.prefill.max(cur.prefill),
                    sim.peak.decode.max(cur.decode),
                );
                if let Some(limit) = cfg.give_up_after_missed {
                    // Windows before `open` have a final verdict already.
                    for j in open..=k {
                        if !sim.windows[j].missed && sim.known_miss(j, now) {
                            sim.windows[j].missed = true;
                        }
                    }
                    while open <= k && sim.windows[open].pending == 0 {
                        open += 1;
                    }
                    let missed = sim.windows[..=k].iter().filter(|w| w.missed).count();
                    if missed > limit {
                        gave_up = true;
                        break;
                    }
                }
                if k + 1 < n_windows {
                    sim.push((k as f64 + 2.0) * cfg.window_s, Ev::Window(k + 1));
                }
            }
        }
    }
    let horizon = n_windows as f64 * cfg.window_s;
    let mut by_role = [0.0f64; 2];
    for inst in &sim.insts {
        let end = inst.gone.unwrap_or(horizon).min(horizon);
        by_role[usize::from(inst.role == Role::Decode)] += (end - inst.started).max(0.0);
    }
    let sla = cfg.sla;
    let windows: Vec<WindowReport> = sim
        .windows
        .iter_mut()
        .enumerate()
        .map(|(j, w)| {
            let ttft = quantile(&mut w.ttft, 0.9);
            let itl = w.itl.quantile(0.9);
            // A request that never got its first token (a run given up) misses.
            let ttft_ok = w.pending == 0 && ttft.is_none_or(|v| v <= sla.ttft_s);
            let itl_ok = itl.is_none_or(|v| v <= sla.itl_s);
            let meets = match cfg.judge {
                Judge::Both => ttft_ok && itl_ok,
                Judge::Ttft => ttft_ok,
                Judge::Itl => itl_ok,
            } && !w.missed;
            WindowReport {
                start_s: j as f64 * cfg.window_s,
                arrivals: w.arrivals,
                ttft_p90_s: ttft,
                itl_p90_s: itl,
                meets,
                split: w.split,
                reason: std::mem::take(&mut w.reason),
            }
        })
        .collect();
    Ok(SimReport {
        windows_meeting: windows.iter().filter(|w| w.meets).count(),
        windows,
        instance_seconds: by_role[0] + by_role[1],
        prefill_instance_seconds: by_role[0],
        decode_instance_seconds: by_role[1],
        ttft_p90_s: quantile(&mut sim.ttft_all, 0.9),
        itl_p90_s: sim.itl_all.quantile(0.9),
        requests: sim.reqs.len() as u64,
        completed: sim.completed,
        peak: sim.peak,
        prefix_hit_rate: if sim.prompt_tokens > 0.0 {
            sim.hit_tokens / sim.prompt_tokens
        } else {
            0.0
        },
        gave_up,
        events,
    })
}
