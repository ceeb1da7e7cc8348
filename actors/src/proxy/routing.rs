//! Where the proxy sends a request: the routing decision as a pure function of the routable
//! instances and their loads.
//!
//! The least-loaded instance of a role wins (fewest queued + running requests, then most free
//! KV blocks), round-robin among equals (one counter per role: a shared one would make every
//! pick of one role land on the same instance when the picks of the two roles alternate). With
//! `max_prefill_queue` set, a request arriving while even the least-loaded prefill instance has
//! more requests than that goes to the decode instance alone, which prefills it itself
//! (conditional disaggregation).

use super::registry::{Registry, Upstream};
use crate::error::RequestError;
use pdserve_runtime::Role;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

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

/// Picks the instances of one request at `now`, least-loaded.
///
/// # Errors
/// [`RequestError::Overloaded`] naming the role that has no routable instance.
pub fn route(
    registry: &Registry,
    rr: &RoundRobin,
    max_prefill_queue: Option<usize>,
    now: Instant,
) -> Result<Route, RequestError> {
    route_with(registry, max_prefill_queue, now, |role, c| {
        least_loaded(c, role, rr).cloned()
    })
}

/// Picks the instances of one request at `now`: `choose` picks one of a role's routable
/// instances.
///
/// # Errors
/// [`RequestError::Overloaded`] naming the role that has no routable instance.
pub fn route_with(
    registry: &Registry,
    max_prefill_queue: Option<usize>,
    now: Instant,
    mut choose: impl FnMut(Role, &[Upstream]) -> Option<Upstream>,
) -> Result<Route, RequestError> {
    let prefills = registry.routable_at(Role::Prefill, now);
    let decodes = registry.routable_at(Role::Decode, now);
    if prefills.is_empty() {
        return Err(RequestError::Overloaded(
            "no prefill instance is available".into(),
        ));
    }
    if decodes.is_empty() {
        return Err(RequestError::Overloaded(
            "no decode instance is available".into(),
        ));
    }
    // The queue rule looks at the least-loaded prefill instance, whichever router runs.
    let least_busy_prefill = prefills
        .iter()
        .map(|u| u.load.map_or(0, |(busy, _)| busy))
        .min()
        .unwrap_or(0);
    if max_prefill_queue.is_some_and(|max| least_busy_prefill > max) {
        let decode = choose(Role::Decode, &decodes)
            .ok_or_else(|| RequestError::Overloaded("no decode instance is available".into()))?;
        return Ok(Route::LocalPrefill {
            decode,
            prefill_queue: least_busy_prefill,
        });
    }
    let prefill = choose(Role::Prefill, &prefills)
        .ok_or_else(|| RequestError::Overloaded("no prefill instance is available".into()))?;
    let decode = choose(Role::Decode, &decodes)
        .ok_or_else(|| RequestError::Overloaded("no decode instance is available".into()))?;
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvView {
    /// Leading prompt blocks the instance holds in its prefix cache.
    pub overlap: usize,
    /// Full blocks of the prompt.
    pub prompt_blocks: usize,
    /// Prompt blocks of requests this proxy sent it that it still prefills.
    pub active_prefill_blocks: usize,
    /// Blocks of requests this proxy sent it that it still decodes.
    pub active_decode_blocks: usize,
}

/// Dynamo's cost: `scale·max(active_prefill + prompt − overlap, 0) + active_decode`. The
/// overlap is a credit against the work a request adds; the load terms keep one hot prefix
/// from piling onto the instance that holds it (it moves once that instance is busier, in
/// blocks, than the credit is worth).
pub fn kv_cost(v: &KvView, prefill_load_scale: f64) -> f64 {
    prefill_load_scale
        * (v.active_prefill_blocks + v.prompt_blocks).saturating_sub(v.overlap) as f64
        + v.active_decode_blocks as f64
}

/// Why the router picked an instance (`pdserve_router_decisions_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Reason {
    /// KV router: the pick holds the longest cached prefix of the prompt.
    KvOverlap,
    /// KV router: another instance holds more of the prefix but is busier than the credit.
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
    let reason = if most == 0 {
        Reason::NoOverlap
    } else if views[i].overlap == most {
        Reason::KvOverlap
    } else {
        Reason::Load
    };
    Some((&candidates[i], reason))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pick_decode(r: &Registry, rr: &RoundRobin) -> String {
        match route(r, rr, None, Instant::now()).unwrap() {
            Route::Disaggregated { decode, .. } => decode.url,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn picks_least_loaded_live_instance_with_round_robin_ties() {
        let mut r = Registry::default();
        let rr = RoundRobin::default();
        r.add(Role::Decode, "http://a:1");
        r.add(Role::Decode, "http://b:1");
        r.add(Role::Prefill, "http://p:1");
        assert!(
            matches!(route(&r, &rr, None, Instant::now()), Err(RequestError::Overloaded(m)) if m.contains("prefill")),
            "nothing has answered yet"
        );
        r.record("http://a:1", Some((0, 100)));
        r.record("http://b:1", Some((0, 100)));
        r.record("http://p:1", Some((3, 10)));
        // As the proxy picks: a prefill, then a decode, per request.
        let picks: Vec<_> = (0..4).map(|_| pick_decode(&r, &rr)).collect();
        assert!(
            picks.contains(&"http://a:1".to_string()) && picks.contains(&"http://b:1".to_string()),
            "{picks:?}"
        );
        r.record("http://a:1", Some((5, 100)));
        assert_eq!(pick_decode(&r, &rr), "http://b:1", "fewer requests wins");
        r.record("http://b:1", Some((5, 50)));
        assert_eq!(pick_decode(&r, &rr), "http://a:1", "then more free blocks");
        for _ in 0..super::super::MISSED_POLLS_TO_DROP {
            r.record("http://a:1", None);
        }
        assert_eq!(pick_decode(&r, &rr), "http://b:1", "a missed its polls");
    }

    fn ups(n: usize) -> Vec<Upstream> {
        let mut r = Registry::default();
        for i in 0..n {
            let url = format!("http://d{i}:1");
            r.add(Role::Decode, url.as_str());
            r.record(&url, Some((0, 100)));
        }
        r.routable_at(Role::Decode, Instant::now())
    }

    #[test]
    fn the_kv_router_follows_the_prefix_until_load_outweighs_it() {
        let c = ups(2);
        let rr = RoundRobin::default();
        let view = |overlap, active| KvView {
            overlap,
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
    fn a_busy_prefill_pool_sends_the_request_to_decode_alone() {
        let mut r = Registry::default();
        let rr = RoundRobin::default();
        r.add(Role::Decode, "http://d:1");
        r.add(Role::Prefill, "http://p:1");
        r.record("http://d:1", Some((0, 100)));
        r.record("http://p:1", Some((3, 10)));
        assert!(matches!(
            route(&r, &rr, Some(2), Instant::now()).unwrap(),
            Route::LocalPrefill {
                prefill_queue: 3,
                ..
            }
        ));
        assert!(matches!(
            route(&r, &rr, Some(3), Instant::now()).unwrap(),
            Route::Disaggregated { .. }
        ));
        assert!(matches!(
            route(&Registry::default(), &rr, None, Instant::now()),
            Err(RequestError::Overloaded(_))
        ));
    }
}
