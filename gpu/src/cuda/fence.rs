//! The device-side fence of a rank (`pdserve-cuda{rank}-fence`), without the device: what a
//! peer may be told about KV is decided here.
//!
//! The rank thread queues work on its stream and, behind the work a peer will depend on (a
//! layer's K/V write and its device → mirror copy, a mirror → device upload), records a
//! completion point (a CUDA event) and hands [`FenceItem::After`] to the fence thread. The
//! fence thread takes items in the order they were queued and, for each, waits for its point
//! to complete **on the device** and only then runs its continuation (the layer hook that
//! announces the layer, the upload's `done`). So:
//!
//! 1. nothing is announced before the stream that wrote it has completed (host-side
//!    bookkeeping alone never announces a block: ATOM's and Mooncake's P/D rule);
//! 2. announcements keep stream order (layer 3 is never announced before layer 2);
//! 3. a point that fails (a device error) announces nothing: its continuation gets the error;
//! 4. a [`FenceItem::Barrier`] answers only once every item queued before it has run, which
//!    is how a step is reported done only after all of its layer hooks.
//!
//! [`run`] is generic over the completion point ([`Completion`]): the CUDA executor uses
//! CUDA events, the tests a fake whose completion they control.

use crate::ModelError;
use std::sync::mpsc::{Receiver, SyncSender};

/// A point in a stream's work that can be waited for (a recorded CUDA event on a GPU).
pub trait Completion: Send {
    /// Blocks until the work before the point completed; `Err` when the device failed it.
    fn wait(&self) -> Result<(), ModelError>;
}

/// What runs once a completion point is reached (or failed).
pub type Continuation = Box<dyn FnOnce(Result<(), ModelError>) + Send>;

/// One item of the fence thread's queue.
pub enum FenceItem<E> {
    /// Run `then` once `point` completed, with `point`'s error if it failed.
    After {
        /// The completion point.
        point: E,
        /// What depends on it.
        then: Continuation,
    },
    /// Answer once everything queued before has run.
    Barrier(SyncSender<()>),
}

/// The fence thread's loop: items in queue order, each continuation after its point. Returns
/// when every sender is gone.
pub fn run<E: Completion>(items: Receiver<FenceItem<E>>) {
    while let Ok(item) = items.recv() {
        match item {
            FenceItem::After { point, then } => then(point.wait()),
            FenceItem::Barrier(tx) => {
                let _ = tx.send(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::{channel, sync_channel, Sender};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    /// A completion point the test completes (or fails) by hand.
    struct Point(Mutex<Receiver<Result<(), String>>>);

    impl Completion for Point {
        fn wait(&self) -> Result<(), ModelError> {
            match self.0.lock().unwrap().recv() {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(ModelError::RankFailed { rank: 0, reason: e }),
                Err(_) => Err(ModelError::RankFailed {
                    rank: 0,
                    reason: "stream gone".into(),
                }),
            }
        }
    }

    fn point() -> (Point, Sender<Result<(), String>>) {
        let (tx, rx) = channel();
        (Point(Mutex::new(rx)), tx)
    }

    type Log = Arc<Mutex<Vec<String>>>;

    fn announce(log: &Log, name: &str) -> Continuation {
        let (log, name) = (log.clone(), name.to_string());
        Box::new(move |r| {
            log.lock().unwrap().push(match r {
                Ok(()) => name,
                Err(_) => format!("{name} failed"),
            })
        })
    }

    /// Queues `name`'s announcement behind a new point; returns the point's trigger.
    fn after(
        fence: &Sender<FenceItem<Point>>,
        log: &Log,
        name: &str,
    ) -> Sender<Result<(), String>> {
        let (point, trigger) = point();
        fence
            .send(FenceItem::After {
                point,
                then: announce(log, name),
            })
            .unwrap();
        trigger
    }

    fn settle() {
        std::thread::sleep(Duration::from_millis(20));
    }

    #[test]
    fn layers_are_announced_only_after_their_point_and_in_stream_order() {
        let (tx, rx) = channel();
        let fence = std::thread::spawn(move || run(rx));
        let log: Log = Arc::default();
        let c1 = after(&tx, &log, "layer 1");
        let c2 = after(&tx, &log, "layer 2");
        let (btx, brx) = sync_channel(1);
        tx.send(FenceItem::Barrier(btx)).unwrap();

        // Layer 2's work completed first: nothing may be announced (layer 1 is still
        // running), and the step may not be reported done.
        c2.send(Ok(())).unwrap();
        settle();
        assert!(log.lock().unwrap().is_empty());
        assert!(brx.try_recv().is_err());

        // Layer 1 completes: both are announced, in order, and then the barrier answers.
        c1.send(Ok(())).unwrap();
        brx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(*log.lock().unwrap(), ["layer 1", "layer 2"]);
        drop(tx);
        fence.join().unwrap();
    }

    #[test]
    fn a_failed_point_announces_nothing_and_later_items_still_run() {
        let (tx, rx) = channel();
        let fence = std::thread::spawn(move || run(rx));
        let log: Log = Arc::default();
        let c1 = after(&tx, &log, "upload");
        let c2 = after(&tx, &log, "layer 0");
        c1.send(Err("illegal address".into())).unwrap();
        c2.send(Ok(())).unwrap();
        let (btx, brx) = sync_channel(1);
        tx.send(FenceItem::Barrier(btx)).unwrap();
        brx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(*log.lock().unwrap(), ["upload failed", "layer 0"]);
        drop(tx);
        fence.join().unwrap();
    }

    #[test]
    fn a_barrier_waits_for_every_point_queued_before_it_and_no_later_one() {
        let (tx, rx) = channel();
        let fence = std::thread::spawn(move || run(rx));
        let log: Log = Arc::default();
        let c1 = after(&tx, &log, "layer 0");
        let (btx, brx) = sync_channel(1);
        tx.send(FenceItem::Barrier(btx)).unwrap();
        let c2 = after(&tx, &log, "next step's layer 0");
        settle();
        assert!(
            brx.try_recv().is_err(),
            "the barrier answered before its layer"
        );
        c1.send(Ok(())).unwrap();
        brx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(*log.lock().unwrap(), ["layer 0"]);
        c2.send(Ok(())).unwrap();
        drop(tx);
        fence.join().unwrap();
        assert_eq!(*log.lock().unwrap(), ["layer 0", "next step's layer 0"]);
    }
}
