//! Timers that end with their actor.
//!
//! An actor that needs a message later (a periodic tick, a deadline) keeps a [`Timers`] in
//! its state and starts them there. Every timer is a task in the set; when the state drops
//! — the actor stopped, failed, or its supervisor restarted it — the set aborts each timer
//! still pending, so no timer outlives the incarnation that started it or messages the next
//! one. A timer whose message no longer matters is cancelled with [`Timer::cancel`].

use crate::mailbox::Mailbox;
use std::time::Duration;
use tokio::task::{AbortHandle, JoinSet};

/// The timers of one actor incarnation; dropping it aborts them all.
#[derive(Debug, Default)]
pub struct Timers {
    set: JoinSet<()>,
}

/// One pending timer of a [`Timers`] set. Dropping it leaves the timer running (it still
/// ends with its set).
#[derive(Debug)]
pub struct Timer(AbortHandle);

impl Timer {
    /// Stops the timer; its message is not sent if it was not yet.
    pub fn cancel(self) {
        self.0.abort();
    }
}

impl Timers {
    /// Sends `make()` to `to` every `period`, the first one `period` from now. A tick that
    /// comes late is sent late, not twice. Ends when the set drops or `to` is gone.
    pub fn every<M: ractor::Message>(
        &mut self,
        period: Duration,
        to: Mailbox<M>,
        make: impl Fn() -> M + Send + 'static,
    ) -> Timer {
        self.reap();
        Timer(self.set.spawn(async move {
            let mut every = tokio::time::interval(period);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            every.tick().await; // an interval's first tick is now
            loop {
                every.tick().await;
                if to.cast(make()).is_err() {
                    return;
                }
            }
        }))
    }

    /// Sends `msg` to `to` once, `delay` from now.
    pub fn after<M: ractor::Message>(&mut self, delay: Duration, to: Mailbox<M>, msg: M) -> Timer {
        self.reap();
        Timer(self.set.spawn(async move {
            tokio::time::sleep(delay).await;
            // The actor is gone only when its state (and so this set) is being dropped.
            let _ = to.cast(msg);
        }))
    }

    /// Timers started and not yet ended (fired once, cancelled, or their actor gone).
    pub fn pending(&mut self) -> usize {
        self.reap();
        self.set.len()
    }

    /// Forgets the timers that ended, so a long-lived actor's set stays as small as what is
    /// pending.
    fn reap(&mut self) {
        while self.set.try_join_next().is_some() {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mailbox::Inbox;
    use ractor::{Actor, ActorProcessingErr, ActorRef};
    use std::sync::{Arc, Weak};
    use tokio::sync::mpsc;

    #[derive(Debug)]
    enum Msg {
        Tick,
        /// Carries a token: while a timer holds this message, the token lives.
        Deadline(#[allow(dead_code)] Arc<()>),
        Cancelled,
        Stop,
    }

    /// Reports its messages; starts a tick, a deadline an hour away and a cancelled timer.
    struct Ticked(Inbox, mpsc::UnboundedSender<String>);

    impl Actor for Ticked {
        type Msg = Msg;
        type State = Timers;
        type Arguments = Arc<()>;

        async fn pre_start(
            &self,
            myself: ActorRef<Msg>,
            token: Arc<()>,
        ) -> Result<Timers, ActorProcessingErr> {
            let me = Mailbox::of(&myself, &self.0);
            let mut timers = Timers::default();
            timers.every(Duration::from_millis(5), me.clone(), || Msg::Tick);
            timers.after(Duration::from_secs(3600), me.clone(), Msg::Deadline(token));
            timers
                .after(Duration::from_millis(1), me, Msg::Cancelled)
                .cancel();
            Ok(timers)
        }

        async fn handle(
            &self,
            myself: ActorRef<Msg>,
            msg: Msg,
            timers: &mut Timers,
        ) -> Result<(), ActorProcessingErr> {
            self.0.take();
            let _ = self.1.send(format!("{msg:?} pending={}", timers.pending()));
            if matches!(msg, Msg::Stop) {
                myself.stop(None);
            }
            Ok(())
        }
    }

    #[tokio::test]
    async fn an_actors_timers_tick_and_end_with_it() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let token = Arc::new(());
        let held: Weak<()> = Arc::downgrade(&token);
        let (m, join) = Mailbox::spawn(None, |inbox| Ticked(inbox, tx), token)
            .await
            .unwrap();
        // Ticks arrive; the tick and the deadline are pending, the cancelled timer is not.
        for _ in 0..3 {
            let got = tokio::time::timeout(Duration::from_secs(5), rx.recv())
                .await
                .expect("a tick within 5 s");
            assert_eq!(got.as_deref(), Some("Tick pending=2"));
        }
        assert!(
            held.upgrade().is_some(),
            "the deadline timer holds its message"
        );
        m.cast(Msg::Stop).unwrap();
        tokio::time::timeout(Duration::from_secs(5), join)
            .await
            .expect("stopped")
            .unwrap();
        // The state dropped with the actor and aborted the deadline an hour early: its
        // message, and the token in it, are gone.
        for _ in 0..500 {
            if held.upgrade().is_none() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert!(held.upgrade().is_none(), "a timer outlived its actor");
        let mut seen = Vec::new();
        while let Ok(msg) = rx.try_recv() {
            seen.push(msg);
        }
        assert!(
            seen.iter()
                .all(|m| m.starts_with("Tick") || m.starts_with("Stop")),
            "{seen:?}"
        );
    }
}
