//! `pdserve-transfer-peer`: a transfer engine peer in its own process, driven by environment
//! variables (see `pdserve_transport::peer`). Used by the conformance tests and the transfer
//! benchmark to put the two ends of a transfer in two real processes.

fn main() {
    if std::env::var_os(pdserve_transport::peer::ENV_BACKEND).is_none() {
        eprintln!(
            "pdserve-transfer-peer is started by pdserve's transfer tests and benchmark; set {} to run it",
            pdserve_transport::peer::ENV_BACKEND
        );
        std::process::exit(2);
    }
    pdserve_transport::peer::run_if_requested();
}
