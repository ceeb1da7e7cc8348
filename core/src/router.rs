//! Where the proxy sends a request: the routing decision as a pure function of the routable
//! instances and their loads. The proxy's registry (liveness, polls, heartbeats) and its HTTP
//! forwarding stay in `pdserve_actors::proxy`; they hand this module the instances routable
//! now.
//!
//! The least-loaded instance of a role wins (fewest queued + running requests, then most free
//! KV blocks), round-robin among equals (one counter per role: a shared one would make every
//! pick of one role land on the same instance when the picks of the two roles alternate). With
//! `max_prefill_queue` set, a request arriving while even the least-loaded prefill instance has
//! more requests than that goes to the decode instance alone, which prefills it itself
//! (conditional disaggregation). The KV router ([`kv_pick`]) weighs each instance's cached
//! prefix of the prompt — each block at its medium's credit: 1 in the block pool, less in a KV
//! tier it must be loaded back from — against its outstanding work ([`kv_cost`]).

use pdserve_runtime::Role;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};

/// One instance the proxy may route to, as routing sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    /// Its HTTP API (`http://host:port`).
    pub url: String,
    /// `(host, port)` of the URL, parsed once when the entry was added.
    pub host_port: Option<(String, u16)>,
    /// Its role.
    pub role: Role,
    /// Its last load: `(queued + running, free blocks)`.
    pub load: Option<(usize, usize)>,
    /// Its control address and node name, when it registered over the control plane.
    pub control: Option<(SocketAddr, String)>,
}

/// No instance of a role can take the request (the proxy answers 503, "overloaded").
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("no {role} instance is available")]
pub struct NoInstance {
    /// The role that has no routable instance.
    pub role: Role,
}

/// Round-robin counters, one per role.
#[derive(Debug, Default)]
pub struct RoundRobin {
    prefill: AtomicUsize,
    decode: AtomicUsize,
}

impl RoundRobin {
    fn next(&self, role: Role) -> usize {
        let c = if role == Role::Decode {
            &self.decode
        } else {
            &self.prefill
        };
        c.fetch_add(1, Ordering::Relaxed)
    }
}

/// The least-loaded of `candidates`, round-robin among equals.
pub fn least_loaded<'a>(
    candidates: &'a [Upstream],
    role: Role,
    rr: &RoundRobin,
) -> Option<&'a Upstream> {
    let key = |u: &Upstream| {
        u.load
            .map(|(busy, free)| (busy, usize::MAX - free))
            .unwrap_or((usize::MAX, usize::MAX))
    };
    let best = candidates.iter().map(key).min()?;
    let ties: Vec<&Upstream> = candidates.iter().filter(|u| key(u) == best).collect();
    Some(ties[rr.next(role) % ties.len()])
}

/// Where one request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// Prefill on `prefill`, decode on `decode` (the decode instance drives the hand-off).
    Disaggregated {
        /// The prefill instance.
        prefill: Upstream,
        /// The decode instance.
        decode: Upstream,
    },
    /// The decode instance prefills the request itself: every prefill instance is busier than
    /// the threshold.
    LocalPrefill {
        /// The decode instance.
        decode: Upstream,
        /// The least-loaded prefill instance's queue.
        prefill_queue: usize,
    },
}

/// Picks the instances of one request among the routable `prefills` and `decodes`: `choose`
/// picks one of a role's routable instances.
///
/// # Errors
/// [`NoInstance`] naming the role that has no routable instance (or none `choose` takes).
pub fn route_among(
    prefills: &[Upstream],
    decodes: &[Upstream],
    max_prefill_queue: Option<usize>,
    mut choose: impl FnMut(Role, &[Upstream]) -> Option<Upstream>,
) -> Result<Route, NoInstance> {
    let none = |role| NoInstance { role };
    if prefills.is_empty() {
        return Err(none(Role::Prefill));
    }
    if decodes.is_empty() {
        return Err(none(Role::Decode));
    }
    // The queue rule looks at the least-loaded prefill instance, whichever router runs.
    let least_busy_prefill = prefills
        .iter()
        .map(|u| u.load.map_or(0, |(busy, _)| busy))
        .min()
        .unwrap_or(0);
    if max_prefill_queue.is_some_and(|max| least_busy_prefill > max) {
        let decode = choose(Role::Decode, decodes).ok_or(none(Role::Decode))?;
        return Ok(Route::LocalPrefill {
            decode,
            prefill_queue: least_busy_prefill,
        });
    }
    let prefill = choose(Role::Prefill, prefills).ok_or(none(Role::Prefill))?;
    let decode = choose(Role::Decode, decodes).ok_or(none(Role::Decode))?;
    Ok(Route::Disaggregated { prefill, decode })
}

/// Round-robin over `candidates`, whatever their load.
pub fn round_robin<'a>(
    candidates: &'a [Upstream],
    role: Role,
    rr: &RoundRobin,
) -> Option<&'a Upstream> {
    if candidates.is_empty() {
        return None;
    }
    Some(&candidates[rr.next(role) % candidates.len()])
}

/// One candidate instance as the KV router sees it, in blocks.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct KvView {
    /// Leading prompt blocks the instance holds, in its prefix cache or its KV tiers.
    pub overlap: usize,
    /// What those blocks are worth: each counts its medium's credit (1 in the pool, less in
    /// a tier it must be loaded back from: `kv_events::KvIndex::credit`). At most `overlap`.
    pub credit: f64,
    /// Full blocks of the prompt.
    pub prompt_blocks: usize,
    /// Prompt blocks of requests this proxy sent it that it still prefills.
    pub active_prefill_blocks: usize,
    /// Blocks of requests this proxy sent it that it still decodes.
    pub active_decode_blocks: usize,
}

/// Dynamo's cost: `scale·max(active_prefill + prompt − credit, 0) + active_decode`. The
/// overlap's credit (blocks, each weighed by the medium it is held at) is a credit against
/// the work a request adds; the load terms keep one hot prefix from piling onto the instance
/// that holds it (it moves once that instance is busier, in blocks, than the credit is worth).
pub fn kv_cost(v: &KvView, prefill_load_scale: f64) -> f64 {
    let credit = v.credit.clamp(0.0, v.overlap as f64);
    prefill_load_scale * ((v.active_prefill_blocks + v.prompt_blocks) as f64 - credit).max(0.0)
        + v.active_decode_blocks as f64
}

/// Why the router picked an instance (`pdserve_router_decisions_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Reason {
    /// KV router: the pick's cached prefix of the prompt (in its pool or its tiers) is worth
    /// the most credit.
    KvOverlap,
    /// KV router: another instance's cached prefix is worth more, but it is busier than the
    /// credit.
    Load,
    /// KV router: no instance holds any of the prefix; lowest load.
    NoOverlap,
    /// KV router without the prompt's tokens (a text prompt and no `proxy.model`): least
    /// loaded.
    Untokenized,
    /// `--router least-loaded`.
    LeastLoaded,
    /// `--router round-robin`.
    RoundRobin,
}

impl Reason {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::KvOverlap => "kv_overlap",
            Self::Load => "load",
            Self::NoOverlap => "no_overlap",
            Self::Untokenized => "untokenized",
            Self::LeastLoaded => "least_loaded",
            Self::RoundRobin => "round_robin",
        }
    }
}

/// The KV router's pick among `candidates` (`views` in the same order): lowest cost, then
/// the least-loaded by their own load reports (round-robin among equals), so that without any
/// cached prefix or outstanding request it routes as `least-loaded` does.
pub fn kv_pick<'a>(
    candidates: &'a [Upstream],
    views: &[KvView],
    prefill_load_scale: f64,
    role: Role,
    rr: &RoundRobin,
) -> Option<(&'a Upstream, Reason)> {
    let costs: Vec<f64> = views
        .iter()
        .map(|v| kv_cost(v, prefill_load_scale))
        .collect();
    let best = costs.iter().copied().fold(f64::INFINITY, f64::min);
    let ties: Vec<usize> = (0..candidates.len().min(costs.len()))
        .filter(|&i| costs[i] <= best)
        .collect();
    let tied: Vec<Upstream> = ties.iter().map(|&t| candidates[t].clone()).collect();
    let pick = least_loaded(&tied, role, rr)?;
    let i = ties[tied.iter().position(|u| u.url == pick.url)?];
    let most = views.iter().map(|v| v.overlap).max().unwrap_or(0);
    let best_credit = views.iter().map(|v| v.credit).fold(0.0, f64::max);
    let reason = if most == 0 {
        Reason::NoOverlap
    } else if views[i].credit >= best_credit && views[i].overlap > 0 {
        Reason::KvOverlap
    } else {
        Reason::Load
    };
    Some((&candidates[i], reason))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn up(role: Role, url: &str, load: (usize, usize)) -> Upstream {
        Upstream {
            url: url.to_string(),
            host_port: None,
            role,
            load: Some(load),
            control: None,
        }
    }

    fn ups(n: usize) -> Vec<Upstream> {
        (0..n)
            .map(|i| up(Role::Decode, &format!("http://d{i}:1"), (0, 100)))
            .collect()
    }

    #[test]
    fn the_kv_router_follows_the_prefix_until_load_outweighs_it() {
        let c = ups(2);
        let rr = RoundRobin::default();
        let view = |overlap: usize, active| KvView {
            overlap,
            credit: overlap as f64,
            prompt_blocks: 10,
            active_prefill_blocks: 0,
            active_decode_blocks: active,
        };
        let pick = |views: [KvView; 2]| {
            let (u, r) = kv_pick(&c, &views, 1.0, Role::Decode, &rr).unwrap();
            (u.url.clone(), r)
        };
        // The holder of 8 of the 10 blocks wins while its extra load stays within the credit.
        for active in [0, 4, 7] {
            assert_eq!(
                pick([view(0, 0), view(8, active)]),
                ("http://d1:1".to_string(), Reason::KvOverlap),
                "active {active}"
            );
        }
        // Busier by more than the 8-block credit: the hot prefix spreads to the other one.
        assert_eq!(
            pick([view(0, 0), view(8, 9)]),
            ("http://d0:1".to_string(), Reason::Load)
        );
        // No overlap anywhere: lowest load.
        assert_eq!(
            pick([view(0, 3), view(0, 1)]),
            ("http://d1:1".to_string(), Reason::NoOverlap)
        );
        // Equal costs alternate.
        let picks: std::collections::HashSet<String> =
            (0..4).map(|_| pick([view(0, 0), view(0, 0)]).0).collect();
        assert_eq!(picks.len(), 2, "{picks:?}");
        // The prefill scale weighs queued prompt work: d0 costs 2·10 = 20, d1 2·(12+10−8) = 28.
        let views = [
            view(0, 0),
            KvView {
                active_prefill_blocks: 12,
                ..view(8, 0)
            },
        ];
        let (u, r) = kv_pick(&c, &views, 2.0, Role::Prefill, &rr).unwrap();
        assert_eq!((u.url.as_str(), r), ("http://d0:1", Reason::Load));
        assert_eq!(kv_cost(&views[1], 0.5), 7.0);
        // An overlap in a lower tier is credited at its discount: 8 blocks on disk at 0.5
        // are worth 4, so 5 blocks of extra load outweigh them where 7 did not in the pool.
        let lower = |active| KvView {
            credit: 4.0,
            ..view(8, active)
        };
        assert_eq!(
            pick([view(0, 0), lower(3)]),
            ("http://d1:1".to_string(), Reason::KvOverlap)
        );
        assert_eq!(
            pick([view(0, 0), lower(5)]),
            ("http://d0:1".to_string(), Reason::Load)
        );
        // 3 pool blocks (credit 3) beat 5 disk blocks (credit 2.5): the better credit, not
        // the longer prefix, is the overlap reason.
        assert_eq!(
            pick([
                KvView {
                    credit: 2.5,
                    ..view(5, 0)
                },
                view(3, 0)
            ]),
            ("http://d1:1".to_string(), Reason::KvOverlap)
        );
        // Any credit beats none; a credit is never worth more than its blocks.
        assert_eq!(
            pick([
                view(0, 0),
                KvView {
                    credit: 0.4,
                    ..view(1, 0)
                }
            ])
            .0,
            "http://d1:1"
        );
        assert_eq!(
            kv_cost(
                &KvView {
                    credit: 99.0,
                    ..view(2, 0)
                },
                1.0
            ),
            8.0
        );
    }

    #[test]
    fn round_robin_ignores_load() {
        let mut c = ups(3);
        c[0].load = Some((50, 0));
        let rr = RoundRobin::default();
        let picks: Vec<String> = (0..6)
            .map(|_| round_robin(&c, Role::Decode, &rr).unwrap().url.clone())
            .collect();
        assert_eq!(picks[..3], picks[3..]);
        assert_eq!(
            picks.iter().collect::<std::collections::HashSet<_>>().len(),
            3
        );
        assert!(round_robin(&[], Role::Decode, &rr).is_none());
    }

    #[test]
    fn least_loaded_prefers_fewer_requests_then_more_free_blocks() {
        let rr = RoundRobin::default();
        let c = vec![
            up(Role::Decode, "http://a:1", (5, 100)),
            up(Role::Decode, "http://b:1", (5, 50)),
            up(Role::Decode, "http://c:1", (6, 900)),
        ];
        assert_eq!(
            least_loaded(&c, Role::Decode, &rr).unwrap().url,
            "http://a:1"
        );
        let mut unknown = c[0].clone();
        unknown.load = None;
        assert_eq!(
            least_loaded(&[unknown.clone(), c[2].clone()], Role::Decode, &rr)
                .unwrap()
                .url,
            "http://c:1",
            "an instance that never answered comes last"
        );
        assert!(least_loaded(&[], Role::Decode, &rr).is_none());
    }

    #[test]
    fn a_busy_prefill_pool_sends_the_request_to_decode_alone() {
        let rr = RoundRobin::default();
        let d = [up(Role::Decode, "http://d:1", (0, 100))];
        let p = [up(Role::Prefill, "http://p:1", (3, 10))];
        let pick = |role, c: &[Upstream]| least_loaded(c, role, &rr).cloned();
        assert!(matches!(
            route_among(&p, &d, Some(2), pick).unwrap(),
            Route::LocalPrefill {
                prefill_queue: 3,
                ..
            }
        ));
        assert!(matches!(
            route_among(&p, &d, Some(3), pick).unwrap(),
            Route::Disaggregated { .. }
        ));
        let err = route_among(&[], &d, None, pick).unwrap_err();
        assert_eq!(err.role, Role::Prefill);
        assert_eq!(err.to_string(), "no prefill instance is available");
        assert_eq!(
            route_among(&p, &[], None, pick).unwrap_err().role,
            Role::Decode
        );
        assert_eq!(
            route_among(&p, &d, None, |_, _| None).unwrap_err().role,
            Role::Prefill,
            "a chooser that takes none"
        );
    }
}
