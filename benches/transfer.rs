//! Transfer-engine benchmark: the same measurement as `pdserve bench transfer`, run with
//! `cargo bench --bench transfer`. Prints the table (and where each peer ran) and writes the
//! rows as JSON to `target/transfer-bench.json`.
//!
//! Set `PDSERVE_BENCH_BACKENDS=shm,tcp` to choose backends. The peer process is
//! `pdserve-transfer-peer` (built by `cargo build --release -p pdserve-transport`), or this
//! binary itself, which acts as the peer when started as one.

use pdserve_transport::bench::{
    print_table, run_transfer_bench_with_placement, TransferBenchOptions,
};

fn main() {
    pdserve_transport::peer::run_if_requested();
    let mut opts = TransferBenchOptions::default();
    if let Ok(list) = std::env::var("PDSERVE_BENCH_BACKENDS") {
        opts.backends = list
            .split(',')
            .map(|b| b.trim().parse().expect("backend name"))
            .collect();
    }
    let (rows, placements) = run_transfer_bench_with_placement(&opts).expect("transfer bench");
    for p in &placements {
        println!("placement: {p}");
    }
    print_table(&rows);
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target")
        .join("transfer-bench.json");
    std::fs::write(&out, serde_json::to_string_pretty(&rows).expect("json"))
        .expect("write bench json");
    println!("rows written to {}", out.display());
}
