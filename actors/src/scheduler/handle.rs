//! [`SchedulerHandle`]: how other code talks to a Scheduler — typed calls, each bounded by the
//! instance's configured actor-call timeout, and request submission with a bounded event
//! channel per request.

use super::{NewRequest, RequestEvent, SchedulerMsg, SchedulerStats};
use crate::error::RequestError;
use crate::handoff::protocol::HandoffError;
use crate::handoff::receiver::KvSource;
use crate::handoff::service::{PrefillDone, PrefillHost, PrefillJob};
use crate::mailbox::{Mailbox, Refused};
use pdserve_gpu::grammar::GrammarCompiler;
use pdserve_runtime::ids::{RequestId, TransferId};
use pdserve_runtime::telemetry as m;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// The events of one request; dropping it aborts the request in the Scheduler.
pub struct RequestStream {
    id: RequestId,
    events: mpsc::Receiver<RequestEvent>,
    scheduler: Mailbox<SchedulerMsg>,
    ended: bool,
}

impl RequestStream {
    /// The request.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// The next event; `None` once the Scheduler dropped the request (it failed or stopped).
    pub async fn next(&mut self) -> Option<RequestEvent> {
        let e = self.events.recv().await;
        if matches!(
            e,
            None | Some(RequestEvent::Finished { .. } | RequestEvent::Failed(_))
        ) {
            self.ended = true;
        }
        e
    }

    /// Marks the request as over for the Scheduler (no abort on drop), e.g. after a timeout
    /// the owner reports itself.
    pub fn keep_running_on_drop(&mut self) {
        self.ended = true;
    }

    /// Marks the request as still to be aborted on drop (e.g. it timed out).
    pub fn abort_on_drop(&mut self) {
        self.ended = false;
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.ended {
            let abort = SchedulerMsg::Abort(self.id);
            self.scheduler.tell(
                pdserve_runtime::supervision::ActorKind::Scheduler,
                "abort",
                abort,
            );
        }
    }
}

/// A typed handle on an instance's Scheduler.
#[derive(Clone)]
pub struct SchedulerHandle {
    mailbox: Mailbox<SchedulerMsg>,
    call_timeout: Duration,
    next_id: Arc<AtomicU64>,
    /// Compiles the grammars of prefill requests from peers off the Scheduler (see
    /// [`SchedulerHandle::with_tokenizer`]).
    tokenizer: Option<pdserve_gpu::Tokenizer>,
}

impl std::fmt::Debug for SchedulerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchedulerHandle")
            .field("call_timeout", &self.call_timeout)
            .finish_non_exhaustive()
    }
}

fn gone(e: impl std::fmt::Display) -> RequestError {
    RequestError::Internal(format!("the scheduler did not answer: {e}"))
}

impl SchedulerHandle {
    /// A handle whose calls wait at most `call_timeout`.
    pub fn new(mailbox: Mailbox<SchedulerMsg>, call_timeout: Duration) -> Self {
        Self {
            mailbox,
            call_timeout,
            next_id: Arc::new(AtomicU64::new(1)),
            tokenizer: None,
        }
    }

    /// This handle, compiling the grammar (structured output) of each prefill request from a
    /// peer with `tokenizer` on a blocking thread before submitting it; without it the
    /// Scheduler compiles such a grammar itself.
    pub fn with_tokenizer(mut self, tokenizer: pdserve_gpu::Tokenizer) -> Self {
        self.tokenizer = Some(tokenizer);
        self
    }

    /// The Scheduler's mailbox.
    pub fn mailbox(&self) -> &Mailbox<SchedulerMsg> {
        &self.mailbox
    }

    /// The bound of every call.
    pub fn call_timeout(&self) -> Duration {
        self.call_timeout
    }

    /// A fresh request id.
    pub fn next_request_id(&self) -> RequestId {
        RequestId(self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    fn call_ms(&self) -> u64 {
        self.call_timeout.as_millis() as u64
    }

    /// Queue and pool figures.
    ///
    /// # Errors
    /// [`RequestError::Internal`] when the Scheduler is gone or does not answer in time.
    pub async fn stats(&self) -> Result<SchedulerStats, RequestError> {
        ractor::call_t!(self.mailbox, SchedulerMsg::Stats, self.call_ms()).map_err(gone)
    }

    /// The prefix cache's stored/removed block hashes since the last call, or a snapshot of
    /// all of them (when `snapshot`, or when events were lost).
    ///
    /// # Errors
    /// [`RequestError::Internal`] when the Scheduler is gone or does not answer in time.
    pub async fn kv_events(
        &self,
        snapshot: bool,
    ) -> Result<crate::kv_events::KvEventBatch, RequestError> {
        ractor::call_t!(
            self.mailbox,
            SchedulerMsg::KvEvents,
            self.call_ms(),
            snapshot
        )
        .map_err(gone)
    }

    fn channel(&self, request: &NewRequest) -> (super::EventSink, mpsc::Receiver<RequestEvent>) {
        // Every event the request can produce: a token per output token, T0 of a remote
        // request, the prompt's logprobs, and the final event. The capacity is a permit count (tokio allocates as
        // events arrive); the cap keeps an absurd `max_tokens`, which the core refuses with
        // `ContextOverflow`, from reaching tokio's limit or wrapping to zero.
        const MAX_EVENTS: usize = 1 << 28;
        mpsc::channel(request.params.max_tokens.clamp(1, MAX_EVENTS) + 4)
    }

    fn stream(&self, id: RequestId, events: mpsc::Receiver<RequestEvent>) -> RequestStream {
        RequestStream {
            id,
            events,
            scheduler: self.mailbox.clone(),
            ended: false,
        }
    }

    /// Offers new work to the Scheduler's bounded mailbox.
    fn offer(&self, msg: SchedulerMsg) -> Result<(), RequestError> {
        self.mailbox.offer(msg).map_err(|refused| match refused {
            Refused::Gone => RequestError::ShuttingDown,
            Refused::Overloaded { capacity } => {
                metrics::counter!(m::REQUESTS_SHED_TOTAL, m::LABEL_REASON => "mailbox")
                    .increment(1);
                RequestError::Overloaded(format!(
                    "{capacity} messages wait for the scheduler (scheduler.mailbox_capacity)"
                ))
            }
        })
    }

    /// Submits a request; its events arrive on the returned stream.
    ///
    /// # Errors
    /// [`RequestError::Overloaded`] when the Scheduler's mailbox is full;
    /// [`RequestError::ShuttingDown`] when the Scheduler is gone.
    pub fn submit(&self, request: NewRequest) -> Result<RequestStream, RequestError> {
        let id = request.id;
        let (sink, events) = self.channel(&request);
        self.offer(SchedulerMsg::Submit { request, sink })?;
        Ok(self.stream(id, events))
    }

    /// Submits a request whose prompt KV comes from a prefill instance.
    ///
    /// # Errors
    /// As [`SchedulerHandle::submit`].
    pub fn submit_remote(
        &self,
        request: NewRequest,
        source: KvSource,
    ) -> Result<RequestStream, RequestError> {
        let id = request.id;
        let (sink, events) = self.channel(&request);
        self.offer(SchedulerMsg::SubmitRemote {
            request,
            sink,
            source,
        })?;
        Ok(self.stream(id, events))
    }

    /// Renews the leases of held transfers; answers those no longer held.
    ///
    /// # Errors
    /// [`RequestError::Internal`] when the Scheduler does not answer in time.
    pub async fn renew_held(
        &self,
        transfers: Vec<TransferId>,
    ) -> Result<Vec<TransferId>, RequestError> {
        ractor::call_t!(
            self.mailbox,
            SchedulerMsg::RenewHeld,
            self.call_ms(),
            transfers
        )
        .map_err(gone)
    }

    /// The blocks held for `transfer`, while its lease lives.
    ///
    /// # Errors
    /// [`RequestError::Internal`] when the Scheduler does not answer in time.
    pub async fn held_blocks(
        &self,
        transfer: TransferId,
    ) -> Result<Option<Vec<u32>>, RequestError> {
        ractor::call_t!(
            self.mailbox,
            SchedulerMsg::HeldBlocks,
            self.call_ms(),
            transfer
        )
        .map_err(gone)
    }

    /// Frees a transfer's held blocks; answers whether they were still held.
    ///
    /// # Errors
    /// [`RequestError::Internal`] when the Scheduler does not answer in time.
    pub async fn release_held(&self, transfer: TransferId) -> Result<bool, RequestError> {
        ractor::call_t!(
            self.mailbox,
            SchedulerMsg::ReleaseHeld,
            self.call_ms(),
            transfer
        )
        .map_err(gone)
    }

    /// Aborts the request computing a transfer or frees its held blocks; answers whether
    /// anything was found.
    ///
    /// # Errors
    /// [`RequestError::Internal`] when the Scheduler does not answer in time.
    pub async fn abort_transfer(&self, transfer: TransferId) -> Result<bool, RequestError> {
        ractor::call_t!(
            self.mailbox,
            SchedulerMsg::AbortTransfer,
            self.call_ms(),
            transfer
        )
        .map_err(gone)
    }
}

fn interrupted(e: RequestError) -> HandoffError {
    HandoffError::Interrupted(e.to_string())
}

impl PrefillHost for SchedulerHandle {
    async fn prefill(&self, job: PrefillJob) -> Result<PrefillDone, HandoffError> {
        let constraint = match (&job.params.grammar, &self.tokenizer) {
            (Some(spec), Some(tokenizer)) => {
                let (spec, tokenizer) = (spec.clone(), tokenizer.clone());
                let compiled = tokio::task::spawn_blocking(move || {
                    GrammarCompiler::for_tokenizer(&tokenizer)?.compile(&spec)
                })
                .await
                .map_err(|e| HandoffError::Interrupted(format!("grammar compilation: {e}")))?;
                Some(compiled.map_err(|e| HandoffError::BadRequest(e.to_string()))?)
            }
            _ => None,
        };
        let request = NewRequest {
            id: self.next_request_id(),
            prompt: job.prompt,
            params: job.params,
            hold_for: Some(job.transfer),
            push: job.push,
            resume: Vec::new(),
            constraint,
            images: job.images,
        };
        let mut events = self.submit(request).map_err(|e| match e {
            RequestError::Overloaded(m) => HandoffError::Overloaded(m),
            e => interrupted(e),
        })?;
        let mut first = None;
        loop {
            match events.next().await {
                Some(RequestEvent::Token {
                    token, logprobs, ..
                }) => {
                    first.get_or_insert((token, logprobs));
                }
                Some(RequestEvent::PromptLogprobs(_)) => {}
                Some(RequestEvent::Finished {
                    held_blocks, usage, ..
                }) => {
                    let (first_token, first_logprobs) = first.ok_or_else(|| {
                        HandoffError::Protocol("the prompt finished without a first token".into())
                    })?;
                    return Ok(PrefillDone {
                        first_token,
                        first_logprobs,
                        held_blocks: held_blocks.unwrap_or_default(),
                        cached_tokens: usage.cached_tokens,
                    });
                }
                Some(RequestEvent::Failed(e)) => {
                    return Err(match e {
                        RequestError::Aborted => HandoffError::Aborted,
                        RequestError::Overloaded(m) => HandoffError::Overloaded(m),
                        RequestError::ShuttingDown => HandoffError::Interrupted(e.to_string()),
                        RequestError::KvTransfer(h) => h,
                        other => HandoffError::PrefillFailed {
                            kind: other.kind().to_string(),
                            message: other.to_string(),
                        },
                    })
                }
                None => {
                    return Err(HandoffError::Interrupted(
                        "the scheduler dropped the request".into(),
                    ))
                }
            }
        }
    }

    async fn renew(&self, transfers: Vec<TransferId>) -> Result<Vec<TransferId>, HandoffError> {
        self.renew_held(transfers).await.map_err(interrupted)
    }

    async fn release(&self, transfer: TransferId) -> Result<bool, HandoffError> {
        self.release_held(transfer).await.map_err(interrupted)
    }

    async fn held_blocks(&self, transfer: TransferId) -> Result<Option<Vec<u32>>, HandoffError> {
        SchedulerHandle::held_blocks(self, transfer)
            .await
            .map_err(interrupted)
    }

    async fn abort_transfer(&self, transfer: TransferId) -> Result<bool, HandoffError> {
        SchedulerHandle::abort_transfer(self, transfer)
            .await
            .map_err(interrupted)
    }

    fn abort_transfer_now(&self, transfer: TransferId) {
        let (tx, _rx) = ractor::concurrency::oneshot();
        let _ = self
            .mailbox
            .cast(SchedulerMsg::AbortTransfer(transfer, tx.into()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mailbox::Inbox;
    use pdserve_gpu::sampling::SamplingParams;
    use ractor::{Actor, ActorProcessingErr, ActorRef};
    use tokio::sync::Semaphore;

    /// Stands in for a Scheduler that is busy: takes one message per permit.
    struct Busy(Inbox);

    impl Actor for Busy {
        type Msg = SchedulerMsg;
        type State = Arc<Semaphore>;
        type Arguments = Arc<Semaphore>;

        async fn pre_start(
            &self,
            _: ActorRef<SchedulerMsg>,
            gate: Arc<Semaphore>,
        ) -> Result<Arc<Semaphore>, ActorProcessingErr> {
            Ok(gate)
        }

        async fn handle(
            &self,
            _: ActorRef<SchedulerMsg>,
            _: SchedulerMsg,
            gate: &mut Arc<Semaphore>,
        ) -> Result<(), ActorProcessingErr> {
            self.0.take();
            gate.acquire().await?.forget();
            Ok(())
        }
    }

    fn job(transfer: u128) -> PrefillJob {
        PrefillJob {
            transfer: TransferId(transfer),
            prompt: vec![1, 2, 3],
            params: SamplingParams::default(),
            push: false,
            images: Vec::new(),
        }
    }

    #[tokio::test]
    async fn a_full_scheduler_mailbox_refuses_new_work_as_overloaded() {
        let gate = Arc::new(Semaphore::new(0));
        let (mailbox, _join) = Mailbox::spawn(None, Busy, gate.clone()).await.unwrap();
        let handle = SchedulerHandle::new(mailbox.with_capacity(2), Duration::from_secs(1));
        let request = |handle: &SchedulerHandle| NewRequest {
            id: handle.next_request_id(),
            prompt: vec![1, 2, 3],
            params: SamplingParams::default(),
            hold_for: None,
            push: false,
            resume: Vec::new(),
            constraint: None,
            images: Vec::new(),
        };
        // One taken (the Scheduler is stuck on it), two queued: the capacity.
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(handle.submit(request(&handle)).unwrap());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        match handle.submit(request(&handle)) {
            Err(RequestError::Overloaded(m)) => {
                assert!(m.contains("scheduler.mailbox_capacity"), "{m}")
            }
            other => panic!("expected overloaded, got {:?}", other.map(|s| s.id())),
        }
        // A decode peer's prompt gets the hand-off's own overloaded error.
        assert!(matches!(
            handle.prefill(job(7)).await,
            Err(HandoffError::Overloaded(_))
        ));
        // Once the Scheduler takes its queue, new work is taken again.
        gate.add_permits(3);
        for _ in 0..500 {
            if handle.mailbox().depth() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        held.push(handle.submit(request(&handle)).unwrap());
        // Dropped streams send their aborts with `cast`, past the capacity.
        drop(held);
        assert!(
            handle.mailbox().depth() >= 4,
            "{}",
            handle.mailbox().depth()
        );
        gate.add_permits(64);
    }
}
