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

/// Picks the instances of one request at `now`.
///
/// # Errors
/// [`RequestError::Overloaded`] naming the role that has no routable instance.
pub fn route(
    registry: &Registry,
    rr: &RoundRobin,
    max_prefill_queue: Option<usize>,
    now: Instant,
) -> Result<Route, RequestError> {
    let prefills = registry.routable_at(Role::Prefill, now);
    let decodes = registry.routable_at(Role::Decode, now);
    let prefill = least_loaded(&prefills, Role::Prefill, rr)
        .ok_or_else(|| RequestError::Overloaded("no prefill instance is available".into()))?;
    let decode = least_loaded(&decodes, Role::Decode, rr)
        .ok_or_else(|| RequestError::Overloaded("no decode instance is available".into()))?;
    let queue = prefill.load.map_or(0, |(busy, _)| busy);
    if max_prefill_queue.is_some_and(|max| queue > max) {
        return Ok(Route::LocalPrefill {
            decode: decode.clone(),
            prefill_queue: queue,
        });
    }
    Ok(Route::Disaggregated {
        prefill: prefill.clone(),
        decode: decode.clone(),
    })
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
