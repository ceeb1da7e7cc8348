//! The proxy's registry of instances, a pure structure (tested without HTTP or QUIC): static
//! entries polled over HTTP, and entries registered over the control plane, kept alive by
//! heartbeats. Time is passed in (`*_at`), so liveness is tested without sleeping.

use super::{MISSED_HEARTBEATS_TO_DROP, MISSED_POLLS_TO_DROP};
use pdserve_runtime::Role;
use std::collections::HashSet;
use std::time::{Duration, Instant};

pub use pdserve_core::router::Upstream;

/// Liveness of an entry that registered over the control plane (heartbeat-driven).
#[derive(Debug, Clone)]
struct Registered {
    node: String,
    control_addr: String,
    heartbeat: Duration,
    last_seen: Instant,
    connected: bool,
    generation: u64,
}

#[derive(Debug, Clone)]
struct Entry {
    upstream: Upstream,
    /// Polls missed in a row (static entries only).
    missed: u32,
    /// It said it is draining (static entries: its load poll answered `ready: false`); not
    /// routed to until it says it is ready again. Registered entries leave by deregistering.
    draining: bool,
    /// `Some` for an entry that registered over the control plane.
    registered: Option<Registered>,
}

impl Entry {
    fn live(&self, now: Instant) -> bool {
        if self.draining {
            return false;
        }
        match &self.registered {
            None => self.missed < MISSED_POLLS_TO_DROP,
            Some(r) => {
                r.connected
                    && now.saturating_duration_since(r.last_seen)
                        < r.heartbeat * MISSED_HEARTBEATS_TO_DROP
            }
        }
    }
}

/// A registered instance as the registry sees it (for `inspect`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegisteredInstance {
    /// Node name.
    pub node: String,
    /// Its role.
    pub role: Role,
    /// Its HTTP API.
    pub url: String,
    /// Its control address.
    pub control_addr: String,
    /// Whether requests are routed to it now.
    pub routable: bool,
    /// Time since its last heartbeat or registration.
    pub since_seen: Duration,
    /// Which registration this is (increases with every registration).
    pub generation: u64,
    /// It said it is draining: finishing what it runs, taking nothing new.
    pub draining: bool,
}

/// `(host, port)` of an `http://host:port` URL.
pub fn host_port(url: &str) -> Option<(String, u16)> {
    let parsed = reqwest::Url::parse(url).ok()?;
    let host = parsed.host_str()?.trim_matches(['[', ']']).to_string();
    Some((host, parsed.port_or_known_default()?))
}

/// The instances a proxy knows.
#[derive(Debug, Default)]
pub struct Registry {
    entries: Vec<Entry>,
    generations: u64,
    /// With etcd discovery: the instances whose etcd record is alive (`None` without etcd).
    /// A registered instance outside it is not routed to (its lease expired: it is frozen
    /// or cut off, even if its control connection has not noticed yet).
    members: Option<HashSet<String>>,
}

impl Registry {
    /// With etcd discovery: the nodes whose etcd record is alive now (`None`: membership is
    /// not kept in etcd). Registered instances outside the set are not routed to; static
    /// entries are not affected.
    pub fn set_members(&mut self, members: Option<HashSet<String>>) {
        self.members = members;
    }

    fn routable(&self, e: &Entry, now: Instant) -> bool {
        let member = match (&self.members, &e.registered) {
            (Some(m), Some(r)) => m.contains(&r.node),
            _ => true,
        };
        member && e.live(now)
    }

    /// Adds a static instance (polled on `/v1/load`).
    pub fn add(&mut self, role: Role, url: impl Into<String>) {
        let url = url.into();
        self.entries.push(Entry {
            upstream: Upstream {
                host_port: host_port(&url),
                url,
                role,
                load: None,
                control: None,
            },
            missed: MISSED_POLLS_TO_DROP,
            draining: false,
            registered: None,
        });
    }

    /// Adds or replaces the entry of `node`, registered over the control plane at `now`: an
    /// older entry of the same node, or any entry of the same URL (a static one included), is
    /// replaced. Returns the registration's generation, which its heartbeats and disconnect
    /// must carry.
    pub fn register(
        &mut self,
        node: &str,
        role: Role,
        url: &str,
        control_addr: &str,
        heartbeat: Duration,
        now: Instant,
    ) -> u64 {
        self.entries.retain(|u| {
            u.upstream.url != url && u.registered.as_ref().is_none_or(|r| r.node != node)
        });
        self.generations += 1;
        self.entries.push(Entry {
            upstream: Upstream {
                url: url.to_string(),
                host_port: host_port(url),
                role,
                load: None,
                control: control_addr.parse().ok().map(|a| (a, node.to_string())),
            },
            missed: 0,
            draining: false,
            registered: Some(Registered {
                node: node.to_string(),
                control_addr: control_addr.to_string(),
                heartbeat,
                last_seen: now,
                connected: true,
                generation: self.generations,
            }),
        });
        self.generations
    }

    fn registered_mut(&mut self, node: &str, generation: u64) -> Option<&mut Entry> {
        self.entries.iter_mut().find(|u| {
            u.registered
                .as_ref()
                .is_some_and(|r| r.node == node && r.generation == generation)
        })
    }

    /// Records a heartbeat of registration `generation` of `node`: `(queued + running, free
    /// blocks)` at `now`. A heartbeat of an older registration is ignored (returns `false`).
    pub fn heartbeat(
        &mut self,
        node: &str,
        generation: u64,
        load: (usize, usize),
        now: Instant,
    ) -> bool {
        let Some(u) = self.registered_mut(node, generation) else {
            return false;
        };
        u.upstream.load = Some(load);
        if let Some(r) = u.registered.as_mut() {
            r.last_seen = now;
        }
        true
    }

    /// Registration `generation` of `node` said it is draining: it is not routed to any more,
    /// and stays listed (`draining`) until its connection closes. Returns whether that
    /// registration was the current one.
    pub fn draining(&mut self, node: &str, generation: u64) -> bool {
        let Some(u) = self.registered_mut(node, generation) else {
            return false;
        };
        u.draining = true;
        true
    }

    /// The control connection of registration `generation` of `node` closed: it is no longer
    /// routed to (its entry stays, for `inspect`, until it registers again). Returns whether
    /// that registration was the current one.
    pub fn disconnect(&mut self, node: &str, generation: u64) -> bool {
        let Some(u) = self.registered_mut(node, generation) else {
            return false;
        };
        if let Some(r) = u.registered.as_mut() {
            r.connected = false;
        }
        true
    }

    /// Records a poll of a static entry: `Some((queued + running, free blocks))`, or `None`
    /// when it failed.
    pub fn record(&mut self, url: &str, load: Option<(usize, usize)>) {
        if let Some(u) = self
            .entries
            .iter_mut()
            .find(|u| u.upstream.url == url && u.registered.is_none())
        {
            match load {
                Some(l) => {
                    u.upstream.load = Some(l);
                    u.missed = 0;
                }
                None => u.missed = u.missed.saturating_add(1),
            }
        }
    }

    /// Records whether the static entry `url` takes new requests (its poll's `ready`): a
    /// draining instance leaves routing at once and comes back when it is ready again.
    pub fn set_ready(&mut self, url: &str, ready: bool) {
        if let Some(u) = self
            .entries
            .iter_mut()
            .find(|u| u.upstream.url == url && u.registered.is_none())
        {
            u.draining = !ready;
        }
    }

    /// Instances of `role` that answered recently.
    pub fn alive(&self, role: Role) -> Vec<String> {
        self.alive_at(role, Instant::now())
    }

    /// URLs of the instances of `role` routable at `now`.
    pub fn alive_at(&self, role: Role, now: Instant) -> Vec<String> {
        self.routable_at(role, now)
            .into_iter()
            .map(|u| u.url)
            .collect()
    }

    /// The instances of `role` routable at `now`, in registry order.
    pub fn routable_at(&self, role: Role, now: Instant) -> Vec<Upstream> {
        self.entries
            .iter()
            .filter(|u| u.upstream.role == role && self.routable(u, now))
            .map(|u| u.upstream.clone())
            .collect()
    }

    /// The last load an instance reported: `(queued + running, free blocks)`.
    pub fn load_of(&self, url: &str) -> Option<(usize, usize)> {
        self.entries
            .iter()
            .find(|u| u.upstream.url == url)?
            .upstream
            .load
    }

    /// All URLs.
    pub fn urls(&self) -> Vec<String> {
        self.entries
            .iter()
            .map(|u| u.upstream.url.clone())
            .collect()
    }

    /// URLs of the static entries (the ones polled over HTTP).
    pub fn static_urls(&self) -> Vec<String> {
        self.entries
            .iter()
            .filter(|u| u.registered.is_none())
            .map(|u| u.upstream.url.clone())
            .collect()
    }

    /// Every registered entry, in registration order, as seen at `now`.
    pub fn registered_at(&self, now: Instant) -> Vec<RegisteredInstance> {
        self.entries
            .iter()
            .filter_map(|u| {
                let r = u.registered.as_ref()?;
                Some(RegisteredInstance {
                    node: r.node.clone(),
                    role: u.upstream.role,
                    url: u.upstream.url.clone(),
                    control_addr: r.control_addr.clone(),
                    routable: self.routable(u, now),
                    since_seen: now.saturating_duration_since(r.last_seen),
                    generation: r.generation,
                    draining: u.draining,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_etcd_only_instances_with_a_live_record_are_routed_to() {
        let t0 = Instant::now();
        let hb = Duration::from_millis(100);
        let mut r = Registry::default();
        r.add(Role::Prefill, "http://p0:1");
        r.record("http://p0:1", Some((0, 10)));
        r.register("d0", Role::Decode, "http://d0:1", "127.0.0.1:1", hb, t0);
        r.register("d1", Role::Decode, "http://d1:1", "127.0.0.1:2", hb, t0);
        assert_eq!(
            r.alive_at(Role::Decode, t0).len(),
            2,
            "no etcd: registration decides"
        );
        // etcd lists d1 only (d0's lease expired): d0 is not routed to, but still listed.
        r.set_members(Some(HashSet::from(["d1".to_string()])));
        assert_eq!(
            r.alive_at(Role::Decode, t0),
            vec!["http://d1:1".to_string()]
        );
        let view = r.registered_at(t0);
        assert!(!view.iter().find(|v| v.node == "d0").unwrap().routable);
        assert!(view.iter().find(|v| v.node == "d1").unwrap().routable);
        assert_eq!(
            r.alive_at(Role::Prefill, t0).len(),
            1,
            "static entries unaffected"
        );
        // d0 put its record again: routed to again.
        r.set_members(Some(HashSet::from(["d0".to_string(), "d1".to_string()])));
        assert_eq!(r.alive_at(Role::Decode, t0).len(), 2);
        // A record without a registration routes nothing.
        r.set_members(Some(HashSet::from(["d9".to_string()])));
        assert!(r.alive_at(Role::Decode, t0).is_empty());
    }

    #[test]
    fn registered_instances_live_by_heartbeat_and_connection() {
        let t0 = Instant::now();
        let hb = Duration::from_millis(100);
        let mut r = Registry::default();
        let g1 = r.register("d0", Role::Decode, "http://d0:1", "127.0.0.1:1", hb, t0);
        assert_eq!(
            r.alive_at(Role::Decode, t0),
            vec!["http://d0:1".to_string()],
            "routable as soon as it registers"
        );
        assert!(
            r.static_urls().is_empty(),
            "registered entries are not polled"
        );
        // Heartbeats keep it alive; three missed intervals drop it.
        assert!(r.heartbeat("d0", g1, (0, 10), t0 + hb));
        assert!(!r.alive_at(Role::Decode, t0 + hb * 3).is_empty());
        assert!(r.alive_at(Role::Decode, t0 + hb * 4).is_empty(), "missed 3");
        let view = r.registered_at(t0 + hb * 4);
        assert_eq!(view.len(), 1, "still listed for inspect");
        assert!(!view[0].routable);
        assert_eq!(view[0].since_seen, hb * 3);
        // A heartbeat brings it back.
        assert!(r.heartbeat("d0", g1, (0, 10), t0 + hb * 5));
        assert!(!r.alive_at(Role::Decode, t0 + hb * 5).is_empty());
        // A draining instance is not routed to, and is listed as draining.
        assert!(r.draining("d0", g1));
        assert!(r.alive_at(Role::Decode, t0 + hb * 5).is_empty(), "draining");
        assert!(r.registered_at(t0 + hb * 5)[0].draining);
        assert!(!r.draining("d0", g1 + 1), "not that registration");
        // A closed connection drops it at once.
        assert!(r.disconnect("d0", g1));
        assert!(r.alive_at(Role::Decode, t0 + hb * 5).is_empty());
        // Registering again replaces the old entry; the old registration's reports are stale.
        let g2 = r.register(
            "d0",
            Role::Decode,
            "http://d0-new:1",
            "127.0.0.1:2",
            hb,
            t0 + hb * 6,
        );
        assert!(g2 > g1);
        assert!(
            !r.heartbeat("d0", g1, (9, 0), t0 + hb * 6),
            "stale heartbeat"
        );
        assert!(!r.disconnect("d0", g1), "stale disconnect");
        assert_eq!(r.registered_at(t0 + hb * 6).len(), 1);
        let up = r.routable_at(Role::Decode, t0 + hb * 6);
        assert_eq!(up.len(), 1);
        assert_eq!(up[0].url, "http://d0-new:1");
        assert_eq!(up[0].host_port, Some(("d0-new".to_string(), 1)));
        assert_eq!(
            up[0].control,
            Some(("127.0.0.1:2".parse().unwrap(), "d0".to_string()))
        );
    }

    #[test]
    fn registration_takes_over_a_static_entry() {
        let t0 = Instant::now();
        let hb = Duration::from_millis(500);
        let mut r = Registry::default();
        r.add(Role::Decode, "http://a:1");
        r.record("http://a:1", Some((0, 100)));
        r.register("a", Role::Decode, "http://a:1", "127.0.0.1:1", hb, t0);
        assert_eq!(
            r.urls(),
            vec!["http://a:1".to_string()],
            "no duplicate entry"
        );
        assert!(r.static_urls().is_empty());
        // A colocated instance is listed but never routed as a P/D role.
        r.register("c", Role::Colocated, "http://c:1", "127.0.0.1:3", hb, t0);
        assert_eq!(r.registered_at(t0).len(), 2);
        assert!(r.alive_at(Role::Prefill, t0).is_empty());
    }

    #[test]
    fn static_entries_drop_after_missed_polls_and_come_back() {
        let mut r = Registry::default();
        r.add(Role::Decode, "http://a:1");
        assert!(r.alive(Role::Decode).is_empty(), "nothing has answered yet");
        r.record("http://a:1", Some((0, 100)));
        assert_eq!(r.alive(Role::Decode).len(), 1);
        for _ in 0..MISSED_POLLS_TO_DROP {
            r.record("http://a:1", None);
        }
        assert!(r.alive(Role::Decode).is_empty());
        r.record("http://a:1", Some((0, 100)));
        assert_eq!(r.load_of("http://a:1"), Some((0, 100)));
        // A draining instance leaves routing at once, and comes back when ready again.
        r.set_ready("http://a:1", false);
        assert!(r.alive(Role::Decode).is_empty(), "draining");
        r.set_ready("http://a:1", true);
        assert_eq!(r.alive(Role::Decode).len(), 1);
        assert_eq!(
            r.routable_at(Role::Decode, Instant::now())[0].host_port,
            Some(("a".to_string(), 1))
        );
    }
}
