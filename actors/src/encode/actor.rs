//! The VisionEncoder actor: an instance's image encoder (every instance of a vision-language
//! model has one), supervised by the InstanceSupervisor, restarted in place when it fails.
//!
//! Encoding is compute, so it runs on an **executor thread of its own**: the actor's handler
//! only queues the job (a bounded queue: past [`MAX_QUEUED_ENCODES`] requests waiting, a new
//! one is refused `Overloaded`) and never blocks; the thread checks, decodes, preprocesses and
//! encodes a request's images ([`crate::multimodal::encode_images`], through the encoder
//! cache) and answers the request directly. A panic in the tower ends the thread: the
//! request it ran gets an error, and the actor fails on its next message (or at once, when it
//! learns of it) so that the supervisor restarts it with a new thread; the cache survives.

use crate::error::RequestError;
use crate::mailbox::{Inbox, Mailbox};
use crate::multimodal::EncoderCache;
use pdserve_gpu::vision::VisionTower;
use pdserve_runtime::config::MultimodalSection;
use pdserve_runtime::supervision::ActorKind;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;
use tokio::sync::oneshot;

/// Requests whose images wait for the executor at most; one more is refused `Overloaded`.
pub const MAX_QUEUED_ENCODES: usize = 1024;

/// What a request's encoding answers.
pub type Encoded = Result<Vec<crate::multimodal::EncodedImage>, RequestError>;

/// Messages of the VisionEncoder.
pub enum VisionEncoderMsg {
    /// Check and encode these image URLs (request order); answer on `reply`.
    Encode {
        /// The request's `image_url`s.
        urls: Vec<String>,
        /// The answer.
        reply: oneshot::Sender<Encoded>,
    },
    /// The executor thread ended (it panicked): fail, so the supervisor restarts us.
    ExecutorDied,
}

/// What the VisionEncoder is (re)started from.
#[derive(Clone)]
pub struct VisionEncoderArgs {
    /// The tower.
    pub tower: Arc<VisionTower>,
    /// The instance's `[multimodal]` limits.
    pub cfg: MultimodalSection,
    /// The instance's encoder cache (kept across restarts).
    pub cache: Arc<EncoderCache>,
}

/// The VisionEncoder actor (its mailbox count).
#[derive(Debug)]
pub struct VisionEncoder(pub Inbox);

/// Its state: the executor thread's queue.
pub struct VisionEncoderState {
    jobs: Option<SyncSender<(Vec<String>, oneshot::Sender<Encoded>)>>,
}

impl Actor for VisionEncoder {
    type Msg = VisionEncoderMsg;
    type State = VisionEncoderState;
    type Arguments = VisionEncoderArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: VisionEncoderArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let (tx, rx) = sync_channel::<(Vec<String>, oneshot::Sender<Encoded>)>(MAX_QUEUED_ENCODES);
        let me = Mailbox::of(&myself, &self.0);
        std::thread::Builder::new()
            .name("pdserve-vision-encoder".into())
            .spawn(move || {
                // Tells the actor when this thread ends by a panic (not when the actor
                // stopped and dropped the queue).
                struct Watch(Mailbox<VisionEncoderMsg>);
                impl Drop for Watch {
                    fn drop(&mut self) {
                        if std::thread::panicking() {
                            self.0.tell(
                                ActorKind::VisionEncoder,
                                "executor_died",
                                VisionEncoderMsg::ExecutorDied,
                            );
                        }
                    }
                }
                let _watch = Watch(me);
                while let Ok((urls, reply)) = rx.recv() {
                    if reply.is_closed() {
                        continue; // the client left while it waited
                    }
                    let answer = crate::multimodal::encode_images(
                        &args.tower,
                        &args.cfg,
                        &args.cache,
                        &urls,
                    );
                    let _ = reply.send(answer);
                }
            })?;
        Ok(VisionEncoderState { jobs: Some(tx) })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        self.0.take();
        match msg {
            VisionEncoderMsg::Encode { urls, reply } => {
                let Some(jobs) = &st.jobs else {
                    return Err("the encoder's executor is gone".into());
                };
                match jobs.try_send((urls, reply)) {
                    Ok(()) => Ok(()),
                    Err(TrySendError::Full((_, reply))) => {
                        let _ = reply.send(Err(RequestError::Overloaded(format!(
                            "{MAX_QUEUED_ENCODES} requests' images are waiting for the image encoder"
                        ))));
                        Ok(())
                    }
                    // The thread is gone: the request's reply drops (its caller gets an
                    // error), and we fail to be restarted with a new thread.
                    Err(TrySendError::Disconnected(_)) => {
                        Err("the image encoder's executor thread ended".into())
                    }
                }
            }
            VisionEncoderMsg::ExecutorDied => {
                st.jobs = None;
                Err("the image encoder's executor thread panicked".into())
            }
        }
    }
}

/// The VisionEncoder's address.
#[derive(Clone, Debug)]
pub struct VisionEncoderHandle(Mailbox<VisionEncoderMsg>);

impl VisionEncoderHandle {
    /// The handle of the VisionEncoder behind `mailbox`.
    pub fn new(mailbox: Mailbox<VisionEncoderMsg>) -> Self {
        Self(mailbox)
    }

    /// Checks and encodes a request's images (request order), through the encoder cache.
    ///
    /// # Errors
    /// The first image refused (a 400), `Overloaded` when the queue is full, or
    /// [`RequestError::WorkerFailed`] when the encoder is gone or failed while encoding.
    pub async fn encode(&self, urls: Vec<String>) -> Encoded {
        let (reply, answer) = oneshot::channel();
        let msg = VisionEncoderMsg::Encode { urls, reply };
        if !self.0.tell(ActorKind::VisionEncoder, "encode", msg) {
            return Err(RequestError::WorkerFailed(
                "the image encoder is gone (restarting): try again".into(),
            ));
        }
        answer.await.map_err(|_| {
            RequestError::WorkerFailed("the image encoder failed while encoding".into())
        })?
    }
}
