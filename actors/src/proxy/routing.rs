//! Where the proxy sends a request: the registry's routable instances handed to the pure
//! routing decision of [`pdserve_core::router`] (least loaded, round-robin ties, conditional
//! disaggregation, the KV router's cost), re-exported here, at `now`.

use super::registry::Registry;
use crate::error::RequestError;
use pdserve_runtime::Role;
use std::time::Instant;

pub use pdserve_core::router::{
    kv_cost, kv_pick, least_loaded, round_robin, KvView, NoInstance, Reason, RoundRobin, Route,
    Upstream,
};

impl From<NoInstance> for RequestError {
    fn from(e: NoInstance) -> Self {
        RequestError::Overloaded(e.to_string())
    }
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
    choose: impl FnMut(Role, &[Upstream]) -> Option<Upstream>,
) -> Result<Route, RequestError> {
    let prefills = registry.routable_at(Role::Prefill, now);
    let decodes = registry.routable_at(Role::Decode, now);
    Ok(pdserve_core::router::route_among(
        &prefills,
        &decodes,
        max_prefill_queue,
        choose,
    )?)
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
