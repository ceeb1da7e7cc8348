//! The bounds of every length and count on the control plane's wire, checked on a received
//! archive after it validates and before anything is deserialized from it (so nothing out of
//! bounds is ever built, let alone reaches shared state).
//!
//! Byte bodies (`Opaque`, `Notify`) are bounded by the frame itself
//! ([`super::DEFAULT_MAX_FRAME_BYTES`] or the connection's limit); every string and list is
//! bounded here. A field past its bound is a [`WireError::FieldTooLong`] or
//! [`WireError::TooManyItems`] naming the field; an actor tree that is too deep or not a tree
//! is a [`WireError::BadActorTree`].

use rkyv::string::ArchivedString;
use rkyv::vec::ArchivedVec;

use super::kv_events::{ArchivedKvEventBatch, ArchivedKvOp};
use super::{
    ArchivedControlMessage, ArchivedEnvelope, ArchivedInspectAnswer, ArchivedRegionDescriptor,
    WireError,
};
use crate::supervision::{
    ArchivedActorNode, ArchivedClusterMember, ArchivedInstanceSnapshot, ArchivedMemberStatus,
    ArchivedProxySnapshot,
};

/// Longest name: node, cluster, version, role, topic, error kind, actor name and kind, tier,
/// router kind and reason, shared-memory socket.
pub const MAX_NAME_BYTES: usize = 256;
/// Longest address or path: URLs, control addresses, the model name.
pub const MAX_ADDRESS_BYTES: usize = 4096;
/// Longest free text: error messages, an actor's last error, why a member is unreachable.
pub const MAX_TEXT_BYTES: usize = 64 << 10;
/// Most regions in one `RegisteredMemory` answer.
pub const MAX_REGIONS: usize = 4096;
/// Most registration chunks of one region.
pub const MAX_REGION_CHUNKS: usize = 1 << 16;
/// Most actors in one supervision tree.
pub const MAX_ACTORS: usize = 4096;
/// Deepest actor below the root of a supervision tree.
pub const MAX_ACTOR_DEPTH: u32 = 64;
/// Most instances in one cluster snapshot.
pub const MAX_MEMBERS: usize = 4096;
/// Most KV cache tiers of one instance.
pub const MAX_TIERS: usize = 16;
/// Most (role, reason) decision counters of a router.
pub const MAX_ROUTER_DECISIONS: usize = 1024;
/// Most instances in a router's KV index figures.
pub const MAX_INDEXED_INSTANCES: usize = 4096;
/// Most storage media in one indexed instance's figures (pool, host, disk, shared today).
pub const MAX_MEDIA: usize = 16;
/// Most negotiated KV paths (one per prefill peer) in one instance snapshot.
pub const MAX_KV_PATHS: usize = 1024;
/// Most block hashes in one medium's KV-event snapshot (a 16 MiB frame holds about 2 M).
pub const MAX_KV_SNAPSHOT: usize = 1 << 21;
/// Most events (hashes in its ops) of one medium in one KV-event batch: what an instance's
/// log holds between two drains.
pub use super::kv_events::MAX_PENDING_EVENTS as MAX_KV_EVENTS;

fn string(field: &'static str, s: &ArchivedString, max: usize) -> Result<(), WireError> {
    let len = s.len();
    if len > max {
        return Err(WireError::FieldTooLong { field, len, max });
    }
    Ok(())
}

fn name(field: &'static str, s: &ArchivedString) -> Result<(), WireError> {
    string(field, s, MAX_NAME_BYTES)
}

fn address(field: &'static str, s: &ArchivedString) -> Result<(), WireError> {
    string(field, s, MAX_ADDRESS_BYTES)
}

fn text(field: &'static str, s: &ArchivedString) -> Result<(), WireError> {
    string(field, s, MAX_TEXT_BYTES)
}

fn count<T>(field: &'static str, v: &ArchivedVec<T>, max: usize) -> Result<(), WireError> {
    let count = v.len();
    if count > max {
        return Err(WireError::TooManyItems { field, count, max });
    }
    Ok(())
}

/// Checks every bound of a received envelope's message.
///
/// # Errors
/// The first bound exceeded, as a typed [`WireError`].
pub(super) fn check_envelope(env: &ArchivedEnvelope) -> Result<(), WireError> {
    check_message(&env.message)
}

fn check_message(m: &ArchivedControlMessage) -> Result<(), WireError> {
    use ArchivedControlMessage as M;
    match m {
        M::Hello(h) => {
            name("hello.cluster", &h.cluster)?;
            name("hello.node", &h.node)?;
            name("hello.version", &h.version)
        }
        M::Heartbeat(hb) => name("heartbeat.node", &hb.node),
        M::GetRegisteredMemory
        | M::Notify { .. }
        | M::Ping { .. }
        | M::Pong { .. }
        | M::Draining
        | M::DrainingAck
        | M::InspectRequest => Ok(()),
        M::RegisteredMemory { regions } => {
            count("regions", regions, MAX_REGIONS)?;
            regions.iter().try_for_each(check_region)
        }
        M::Error(e) => {
            name("error.kind", &e.kind)?;
            text("error.message", &e.message)
        }
        M::Opaque { topic, .. } => name("opaque.topic", topic),
        M::Register(r) => {
            let r = r.get();
            name("registration.node", &r.node)?;
            address("registration.url", &r.url)?;
            address("registration.control_addr", &r.control_addr)
        }
        M::Registered { proxy } => name("registered.proxy", proxy),
        M::RegistrationRefused(e) => text("refusal.message", &e.message),
        M::KvEvents(batch) => check_kv_events(batch.get()),
        M::Inspect(answer) => match answer.get() {
            ArchivedInspectAnswer::Instance(i) => check_instance(i),
            ArchivedInspectAnswer::Cluster(c) => {
                check_proxy(&c.proxy)?;
                count("cluster.instances", &c.instances, MAX_MEMBERS)?;
                c.instances.iter().try_for_each(check_member)
            }
        },
    }
}

fn check_kv_events(b: &ArchivedKvEventBatch) -> Result<(), WireError> {
    if let Some(s) = b.snapshot.as_ref() {
        count("kv_events.snapshot", s, MAX_KV_SNAPSHOT)?;
    }
    check_kv_ops("kv_events.ops", &b.ops)?;
    count("kv_events.tiers", &b.tiers, MAX_MEDIA)?;
    for t in b.tiers.iter() {
        name("kv_events.tiers.medium", &t.medium)?;
        if let Some(s) = t.snapshot.as_ref() {
            count("kv_events.tiers.snapshot", s, MAX_KV_SNAPSHOT)?;
        }
        check_kv_ops("kv_events.tiers.ops", &t.ops)?;
    }
    Ok(())
}

/// One medium's ops: at most [`MAX_KV_EVENTS`] hashes over all of them.
fn check_kv_ops(field: &'static str, ops: &ArchivedVec<ArchivedKvOp>) -> Result<(), WireError> {
    count(field, ops, MAX_KV_EVENTS)?;
    let count: usize = ops
        .iter()
        .map(|op| match op {
            ArchivedKvOp::Stored(v) | ArchivedKvOp::Removed(v) => v.len(),
        })
        .sum();
    if count > MAX_KV_EVENTS {
        return Err(WireError::TooManyItems {
            field,
            count,
            max: MAX_KV_EVENTS,
        });
    }
    Ok(())
}

fn check_region(r: &ArchivedRegionDescriptor) -> Result<(), WireError> {
    count("region.chunks", &r.chunks, MAX_REGION_CHUNKS)?;
    match r.shm.as_ref() {
        Some(shm) => name("region.shm.socket", &shm.socket),
        None => Ok(()),
    }
}

fn check_actors(nodes: &ArchivedVec<ArchivedActorNode>) -> Result<(), WireError> {
    count("actors", nodes, MAX_ACTORS)?;
    let mut previous: Option<u32> = None;
    for (at, n) in nodes.iter().enumerate() {
        let depth = n.depth.to_native();
        let fits = match previous {
            None => depth == 0,
            Some(p) => depth >= 1 && depth <= p + 1,
        };
        if !fits || depth > MAX_ACTOR_DEPTH {
            return Err(WireError::BadActorTree {
                at,
                depth,
                max_depth: MAX_ACTOR_DEPTH,
            });
        }
        previous = Some(depth);
        name("actor.name", &n.name)?;
        name("actor.kind", &n.kind)?;
        if let Some(e) = n.last_error.as_ref() {
            text("actor.last_error", e)?;
        }
    }
    if previous.is_none() {
        return Err(WireError::BadActorTree {
            at: 0,
            depth: 0,
            max_depth: MAX_ACTOR_DEPTH,
        });
    }
    Ok(())
}

fn check_instance(i: &ArchivedInstanceSnapshot) -> Result<(), WireError> {
    name("instance.instance", &i.instance)?;
    name("instance.role", &i.role)?;
    address("instance.model", &i.model)?;
    count("instance.kv_tiers", &i.kv_tiers, MAX_TIERS)?;
    for t in i.kv_tiers.iter() {
        name("instance.kv_tiers.tier", &t.tier)?;
    }
    count("instance.kv_paths", &i.kv_paths, MAX_KV_PATHS)?;
    for p in i.kv_paths.iter() {
        address("instance.kv_paths.peer", &p.peer)?;
        name("instance.kv_paths.path", &p.path)?;
        name("instance.kv_paths.reason", &p.reason)?;
    }
    check_actors(&i.actors)
}

fn check_proxy(p: &ArchivedProxySnapshot) -> Result<(), WireError> {
    name("proxy.node", &p.node)?;
    name("proxy.cluster", &p.cluster)?;
    address("proxy.url", &p.url)?;
    address("proxy.control_addr", &p.control_addr)?;
    if let Some(r) = p.router.as_ref() {
        name("router.kind", &r.kind)?;
        count("router.decisions", &r.decisions, MAX_ROUTER_DECISIONS)?;
        for d in r.decisions.iter() {
            name("router.decisions.role", &d.role)?;
            name("router.decisions.reason", &d.reason)?;
        }
        count("router.kv_index", &r.kv_index, MAX_INDEXED_INSTANCES)?;
        for k in r.kv_index.iter() {
            address("router.kv_index.url", &k.url)?;
            count("router.kv_index.by_medium", &k.by_medium, MAX_MEDIA)?;
            for m in k.by_medium.iter() {
                name("router.kv_index.by_medium.medium", &m.0)?;
            }
        }
    }
    check_actors(&p.actors)
}

fn check_member(m: &ArchivedClusterMember) -> Result<(), WireError> {
    name("member.node", &m.node)?;
    name("member.role", &m.role)?;
    address("member.url", &m.url)?;
    address("member.control_addr", &m.control_addr)?;
    match &m.status {
        ArchivedMemberStatus::Snapshot(s) => check_instance(s.get()),
        ArchivedMemberStatus::Unreachable(why) => text("member.unreachable", why),
    }
}
