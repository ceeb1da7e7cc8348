//! pdserve's pure protocol cores: plain structs that take inputs (and `now` where time
//! matters) and return decisions, with no async runtime and no actors. The actors of
//! `pdserve-actors` own them and feed them messages; these crates' tests drive them directly.
//!
//! This crate's dependencies exclude tokio, ractor, axum, reqwest, hyper and futures, so the
//! compiler keeps the cores free of waiting, spawning and I/O.
//!
//! | module | what it holds |
//! |---|---|
//! | [`prefix`] | prefix keys: the chained block hashes (a leaf) |
//! | [`kv_events`] | the prefix-cache event log an instance drains for the proxy (pool and KV tiers, by medium), the proxy's `KvIndex` |
//! | [`block_manager`] | the KV block pool: allocation, reference counts, watermark, the prefix cache |
//! | [`handoff`] | the hand-off's error, the joining of its per-rank reports (`Aggregation`, `Epochs`), the KV path negotiated at the handshake (`kv_path`: host or CUDA IPC), the decode side of one hand-off (`pull::PullCore`), the memory of recent aborts (`aborts::RecentAborts`) |
//! | [`planner`] | the SLA planner: throughput mode (forecast + profiled engine curves) and load mode (online regression, ±1), hysteresis and bounds |
//! | [`simulator`] | a deterministic discrete-event P/D cluster built from engine curves, trace generators, the best fixed split |
//! | [`router`] | the proxy's routing decision: least loaded, round-robin, conditional disaggregation, the KV router's cost |

pub mod block_manager;
pub mod handoff;
pub mod kv_events;
pub mod planner;
pub mod prefix;
pub mod router;
pub mod simulator;
