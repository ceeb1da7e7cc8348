//! SIGTERM and SIGINT for the long-running commands (`serve`, `proxy`, `launch`).
//!
//! Each command makes its [`StopSignals`] before it prints that it is ready. A signal sent
//! the moment the ready line appears then always reaches the handler, which drains and
//! stops. It never meets the default action, which kills the process without a drain.

use tokio::signal::unix::{signal, Signal, SignalKind};

/// Listens for SIGTERM and SIGINT from the moment it is made.
pub struct StopSignals {
    term: Signal,
    interrupt: Signal,
}

impl StopSignals {
    /// Starts listening; needs a tokio runtime.
    ///
    /// # Errors
    /// When a handler cannot be installed.
    pub fn new() -> std::io::Result<Self> {
        Ok(Self {
            term: signal(SignalKind::terminate())?,
            interrupt: signal(SignalKind::interrupt())?,
        })
    }

    /// Waits for the next stop signal; says which (`terminate` or `interrupt`).
    pub async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "terminate",
            _ = self.interrupt.recv() => "interrupt",
        }
    }
}
