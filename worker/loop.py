"""The worker: one engine, the Redis components around it, and the step loop that drives them.

The step loop owns the engine and never touches Redis: jobs arrive through ``Admission``
(filled by the queue reader's thread), results leave through each job's sink (the writer's
thread). Each turn it admits what the engine can take, applies cancels and deadlines,
steps the engine, hands outputs on, and tells the reader how much room there is.

Shutdown (SIGTERM, SIGINT): stop reading, keep stepping until the jobs in the engine end
or ``--grace-period`` passes, then release the rest -- each stays pending in its stream,
made idle at once, so the next ``XAUTOCLAIM`` of any live worker (or this worker's own
pending re-read when it comes back under the same name) takes it; its status goes back to
``queued`` and the interrupted start does not count as an attempt.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

from engine.gc_pauses import freeze_startup_heap, thaw_startup_heap
from producers.connection import connect, is_cluster_client
from producers.protocol import ErrorCode, JobResult, Status
from worker import resume
from worker.admission import Admission, Held, Sink, Work
from worker.backlog import BacklogMonitor, CeleryQueueDepth
from worker.cancel import CancelWatcher, Deadlines
from worker.celery_wiring import broker_client, celery_ingress
from worker.component import REDIS_DOWN
from worker.engine_host import EngineBroken, EngineHost, EngineLike, build_engine
from worker.fencing import Fenced
from worker.heartbeat import Heartbeat
from worker.intake import RedisIntake
from worker.logs import event
from worker.metrics import STATS_EVERY_S, Metrics
from worker.outputs import PromptText, deltas, job_result, kv_tokens
from worker.prepare import Preparer, own_tokenizer
from worker.results import ResultWriter
from worker.scripts import Scripts
from worker.settings import WorkerSettings
from worker.start_checks import StartChecks
from worker.ranks import Ranks
from worker.swap_sizing import SwapSizer
from worker.switching import fast_switching

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # how long an idle loop sleeps before looking at deadlines and stats again


class Worker:
    """Wires the components once; ``work()`` runs the loop until a stop is requested."""

    def __init__(self, settings: WorkerSettings, engine: EngineLike | None = None, redis_url: str | None = None) -> None:
        s = self.settings = settings
        url = redis_url or s.redis
        if url is None:
            raise ValueError("redis: no Redis URL given (the CLI starts a private server when --redis is unset)")
        try:
            self.redis = connect(url, socket_timeout=10, socket_connect_timeout=5, health_check_interval=15)
        except ValueError as exc:  # a URL redis-py cannot open: an unknown scheme, a port that is no number
            raise ValueError(f"redis: {exc}") from None
        self.metrics = Metrics(s.metrics_port, s.metrics_host)
        # NOTE: an engine handed in belongs to the caller (tests, the bench), which shuts it down.
        self._owns_engine = engine is None
        built = engine if engine is not None else build_engine(s.engine_kwargs())
        try:
            self._build(s, url, built)
        except BaseException:
            # NOTE: a part refused its setting (--celery-config that does not load, ...): an engine
            # built here is shut down (its GPU memory, its ranks), the connection closed
            self._close(built)
            raise

    def _build(self, s: WorkerSettings, url: str, engine: EngineLike) -> None:
        """Everything around the engine: admission, the Redis parts, Celery, the heartbeat."""
        keys = s.keys
        self.engine = EngineHost(engine, self.metrics, Ranks(s.queues))
        self.engine.on_lane_outputs(self._lane_outputs)  # NOTE: used only while the engine's lane is on
        self.prompt_text = PromptText(self.engine.tokenizer)  # an echo's prompt, named on the step-loop thread
        tokenizer = own_tokenizer(self.engine.tokenizer_path) if self.engine.has_tokenizer else None
        self.admission = Admission(prepare=tokenizer is not None, rank=self.engine.ranks.key,
                                   read_ahead=self.engine.read_ahead)
        self.preparer = Preparer(self.engine.max_model_len, self.admission, tokenizer) if tokenizer is not None else None
        self.held = Held()
        self.deadlines = Deadlines()
        scripts = Scripts(self.redis, keys, s.name)
        self.fenced = Fenced()  # runs lost to another worker: dropped from the engine
        self.writer = ResultWriter(self.redis, keys, scripts, self.held, self.metrics, s.result_ttl, self.fenced,
                                   stream_interval=s.stream_interval_ms / 1000)
        self.intake = RedisIntake(self.redis, keys, s.queues, scripts, self.admission, self.held, self.writer,
                                  self.metrics, claim_idle_seconds=s.claim_idle_seconds,
                                  max_attempts=s.max_attempts, result_ttl=s.result_ttl,
                                  top_queue_reserve=self.engine.top_queue_reserve,
                                  launch_lock=self.engine.launch_lock)
        self.cancels = CancelWatcher(self.redis, keys, self.held, self.admission, s.cancel_poll_seconds)
        # NOTE: kombu's Redis transport has no cluster mode: on a cluster the Celery ingress needs
        # a broker of its own (--celery-broker); without one it is off, said once
        on_cluster = is_cluster_client(self.redis)
        if on_cluster and s.celery and not s.celery_broker:
            event(log, "celery.off_on_cluster", logging.WARNING,
                  hint="Celery tasks are not consumed on a Redis Cluster without --celery-broker")
        self.celery = (celery_ingress(s, url, self.admission, self.held, self.metrics)
                       if s.celery and (s.celery_broker or not on_cluster) else None)
        self._broker = broker_client(s, self.redis) if self.celery is not None else None
        celery_depth = CeleryQueueDepth(self._broker, s.celery_queue) if self._broker is not None else None
        self.backlog = BacklogMonitor(self.redis, keys, s.queues, self.held, self.metrics, celery=celery_depth)
        info = Heartbeat.worker_info(s.name, s.queues, s.model, stale_after_s=s.claim_idle_seconds,
                                     result_ttl_s=s.result_ttl, served_model_name=s.model_name,
                                     celery_queue=s.celery_queue if self.celery is not None else None)
        self.heartbeat = Heartbeat(self.redis, keys, scripts, self.held, s.heartbeat_seconds, self.describe, info,
                                   fenced=self.fenced, metrics=self.metrics)
        self.swap = self._swap_sizer() if s.swap_auto else None
        # NOTE: the components that read jobs or write the worker's record wait for the start checks
        self.checks = StartChecks(self.redis, s, self.heartbeat, lambda: self.request_stop(immediately=True))
        for component in (self.heartbeat, self.intake, self.celery):
            if component is not None:
                component.gate = self.checks.passed
        # Started in this order, stopped in reverse: the readers last in, first out.
        # NOTE: the preparer stops after the readers and before the writer, which takes the
        # release of a job it was tokenizing when the worker stopped.
        self.components = [self.metrics, self.checks, self.writer,
                           *([self.preparer] if self.preparer is not None else []),
                           self.backlog, self.heartbeat, self.cancels, self.intake,
                           *([self.celery] if self.celery is not None else [])]
        self.state = "starting"  # -> running -> draining
        self.finished = 0
        self._stop_requested = threading.Event()
        self._drain_until: float | None = None
        self._next_stats_at = 0.0
        self._next_checkpoint_at = time.monotonic() + s.checkpoint_seconds

    @property
    def refusal(self) -> str | None:
        """Why the start checks, retried once a Redis that was away answered, stopped the worker."""
        return self.checks.refusal

    def _swap_sizer(self) -> SwapSizer | None:
        s = self.settings
        geometry = self.engine.swap_geometry(s.tensor_parallel_size)
        if geometry is None:
            event(log, "swap.fixed", logging.WARNING, reason="this engine cannot resize its swap pool")
            return None
        per_gpu = geometry.kv_bytes_per_token
        return SwapSizer(s.swap_floor_bytes, s.swap_cap_bytes, per_gpu,
                         prior_tokens_per_job=min(geometry.max_model_len, 512),
                         gpu_kv_bytes=per_gpu * geometry.gpu_kv_tokens,
                         max_jobs_in_engine=self.engine.capacity())  # the engine is empty here: all of it

    # --- the loop ------------------------------------------------------------------------------------
    def work(self) -> int:
        """Run until stopped; return the exit code (0 after a clean stop)."""
        fast_switching(True)
        # NOTE: the heap the engine's start-up built is never walked by the collector while the
        # worker runs: full collections of it (about 450,000 objects on an H200 host) stalled the
        # step loop for 0.4-0.8 s at a time (engine/gc_pauses.py)
        frozen = freeze_startup_heap()
        event(log, "worker.heap_frozen", objects=frozen)
        try:
            self.start()
        except BaseException:
            # refused before anything started (a name a live worker holds, a server or layout it
            # cannot run on): give back what the worker holds, so that a process that goes on
            # (an embedding app, the tests) keeps neither a frozen heap nor the short switch interval
            self.state = "draining"
            self._close(self.engine)
            thaw_startup_heap()
            fast_switching(False)
            raise
        code = 0
        try:
            while not self._finished_draining():
                self.admit_new_jobs()
                self.apply_cancels_and_deadlines()
                if self.engine.has_work():
                    self.step_engine()
                else:
                    self.admission.wait_for_work(IDLE_WAIT_S)
                self.housekeeping()
        except EngineBroken as exc:
            event(log, "worker.engine_broken", logging.CRITICAL, error=str(exc))
            code = 1
        finally:
            self.shutdown()
            thaw_startup_heap()
            fast_switching(False)
        return 2 if self.checks.refusal is not None else code

    def start(self) -> None:
        try:
            self.checks.run()
        except REDIS_DOWN as exc:  # Redis is not up yet: the components wait for it, the checks too
            event(log, "worker.start_checks_deferred", logging.WARNING, error=str(exc),
                  hint="no job is read until Redis answers and the name, server and layout checks pass")
        self.state = "running"
        self.housekeeping()
        started: list = []
        try:
            for component in self.components:
                component.start()
                started.append(component)
        except BaseException:  # one failed to start: the ones before it stop again
            for component in reversed(started):
                component.stop()
            raise
        event(log, "worker.started", name=self.settings.name, queues=",".join(self.settings.queues),
              model=self.settings.model, metrics_port=self.metrics.port)

    def admit_new_jobs(self) -> None:
        """Move works from admission into the engine, as many as it can take now."""
        for work in self.admission.take(self.engine.capacity(), max_tokens=self.engine.admit_tokens_per_turn):
            why = self.admission.cancel_reason(work.id)
            if why is not None:
                self.end(work, Status.CANCELLED, error=why, code=ErrorCode.CANCELLED)
                continue
            refused = self.engine.admit(work)
            if refused is not None:
                self.end(work, Status.FAILED, error=refused[0], code=refused[1])
            elif work.job.deadline is not None:
                self.deadlines.add(work.id, work.job.deadline)

    def apply_cancels_and_deadlines(self) -> None:
        self.drop_fenced()
        cancels = self.admission.take_cancels()  # those not in the engine yet apply on admission
        if cancels:
            for work in self.engine.abort(list(cancels)):
                self.end(work, Status.CANCELLED, error=cancels[work.id], code=ErrorCode.CANCELLED)
            self.admission.forget_cancels(self.held)
        now = time.time()
        expired = self.deadlines.expired(now)
        if expired:
            for work in self.engine.abort(expired):
                self.end(work, Status.EXPIRED, error=f"deadline {work.job.deadline:.3f} passed while running",
                         code=ErrorCode.EXPIRED)

    def drop_fenced(self) -> None:
        """Take runs that lost their job to another worker out of the engine, writing nothing.

        A lost run still waiting in admission is dropped when its first write is fenced."""
        for work in self.fenced.take():
            self.held.discard(work)
            if self.engine.holds(work):
                self.engine.abort([work.id])
                self.deadlines.discard(work.id)
                event(log, "job.dropped", logging.WARNING, job=work.id, attempt=work.attempt,
                      reason="another worker owns the job, or it has ended")

    def step_engine(self) -> None:
        started = time.perf_counter()
        late = self.settings.late_admission or bool(self.settings.express_lane_tokens)  # NOTE: the lane runs in its wait
        outputs, failed = self.engine.step(self.admit_new_jobs if late else None)
        self.metrics.step_seconds.observe(time.perf_counter() - started)
        for work, error, code in failed:
            self.end(work, Status.FAILED, error=error, code=code)
        self._end_finished(self._take_outputs(outputs))

    def _end_finished(self, finished: list) -> None:
        now = time.time()
        for work, output in finished:
            self.engine.done(output.request_id)
            if self.swap is not None:
                self.swap.observe_job(kv_tokens(output))
            self.end(work, Status.DONE, result=job_result(work, output, now, self.prompt_text))

    def _take_outputs(self, outputs: list) -> list:
        """Stamp first tokens and publish streamed deltas; returns the finished ``(work, output)``."""
        now = time.time()
        streamed: dict[int, tuple[Sink, list]] = {}  # id(sink) -> (sink, [(work, deltas)])
        finished = []
        for output in outputs:
            work = self.engine.work_of(output.request_id)
            if work is None:
                continue
            if work.first_token_at is None and any(c.token_ids for c in output.outputs):
                work.first_token_at = now
            if work.job.stream:
                streamed.setdefault(id(work.sink), (work.sink, []))[1].append(
                    (work, deltas(work, output, self.prompt_text)))
            if output.finished:
                finished.append((work, output))
        for sink, items in streamed.values():  # NOTE: before the ends: a job's last deltas go first
            sink.publish_step(items)
        return finished

    def _lane_outputs(self, outputs: list) -> None:
        """The express lane's outputs, handed over in the middle of a step's launch
        (``LLMEngine.on_lane_outputs``): first tokens stamped and streamed, and the jobs they
        finish ended, now (so that an error later in the same step cannot fail them again)."""
        self._end_finished(self._take_outputs(outputs))

    def checkpoint_progress(self) -> None:
        """Queue a progress checkpoint of every running job that does not stream and has new tokens.

        NOTE: every ``--checkpoint-seconds`` (2 s by default): a job whose worker dies resumes
        from its last checkpoint, so the generation lost to a kill is bounded by the interval;
        a streamed job needs none, its tokens stream is its checkpoint."""
        for work in self.engine.running():
            if work.job.stream or not resume.can_resume(work.job):
                continue
            ids = self.engine.progress(work)
            if ids is not None and len(ids) > work.checkpointed:
                work.sink.checkpoint(work, ids)
                work.checkpointed = len(ids)

    def end(self, work: Work, status: Status, result: JobResult | None = None, error: str | None = None,
            code: ErrorCode | None = None) -> None:
        self.deadlines.discard(work.id)
        self.finished += 1
        work.sink.finish(work, status, result=result, error=error, code=code)

    def housekeeping(self) -> None:
        """Tell the reader how much room there is; every so often: stats, swap pool, stop requests."""
        if self._stop_requested.is_set() and self._drain_until is None:
            self._begin_drain()
        self.admission.set_capacity(self.engine.capacity())
        now = time.monotonic()
        if now >= self._next_checkpoint_at:
            self._next_checkpoint_at = now + self.settings.checkpoint_seconds
            self.checkpoint_progress()
        if now < self._next_stats_at:
            return
        self._next_stats_at = now + STATS_EVERY_S
        self.metrics.observe_engine(self.engine.stats())
        self.metrics.in_flight.set(len(self.held))
        self.admission.forget_cancels(self.held)
        self.metrics.loop_alive.set(time.time())
        if self.swap is not None and self.state == "running":
            self.swap.tick(self.engine, self.backlog.share())
            self.metrics.swap_target.set(self.swap.last_target)

    # --- stopping ------------------------------------------------------------------------------------
    def request_stop(self, immediately: bool = False) -> None:
        """Ask the loop to drain and stop (safe from a signal handler and any thread)."""
        if immediately or self._stop_requested.is_set():
            self._drain_until = time.monotonic()
        self._stop_requested.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM / SIGINT drain; a second one stops at once (main thread only)."""
        def handle(signum, _frame):
            event(log, "worker.signal", signal=signal.Signals(signum).name)
            self.request_stop()

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)

    def _begin_drain(self) -> None:
        self.state = "draining"
        self._drain_until = time.monotonic() + self.settings.grace_period
        self.intake.stop(timeout=0)
        for work in self.admission.close():
            work.sink.release(work)
        event(log, "worker.draining", in_engine=len(self.engine), grace_s=self.settings.grace_period)

    def _finished_draining(self) -> bool:
        if self._drain_until is None:
            return False
        return not self.engine.has_work() or time.monotonic() >= self._drain_until

    def _close(self, engine: EngineLike) -> None:
        """Shut down ``engine`` when this worker built it, and close the worker's connections."""
        if self._owns_engine:
            engine.shutdown()
        broker = getattr(self, "_broker", None)  # NOTE: not there yet when the wiring failed before it
        if broker is not None and broker is not self.redis:
            broker.close()
        self.redis.close()

    def shutdown(self) -> None:
        """Release unfinished jobs, write everything out, stop the components and the engine."""
        self.state = "draining"
        if self.celery is not None:
            self.celery.stop(timeout=0)  # winds down while the queue reader does
        self.intake.stop()
        self.checkpoint_progress()  # the released jobs resume from here
        left = self.engine.abort_all()
        for work in left + self.admission.close():
            work.sink.release(work)
        for component in reversed(self.components):
            component.stop()
        self.engine.on_lane_outputs(None)  # an engine handed in outlives this worker
        self._close(self.engine)
        try:
            stats = self.engine.stats()
            computed = dict(prompt_tokens=stats.num_prompt_tokens, generated_tokens=stats.num_generation_tokens)
        except Exception:  # an engine that broke or went already: the counts are not worth a failed stop
            computed = {}
        event(log, "worker.stopped", name=self.settings.name, released=len(left), finished=self.finished, **computed)

    def describe(self) -> dict:
        """The live part of this worker's heartbeat record."""
        return {"state": self.state, "in_flight": len(self.held), "capacity": self.admission.room(),
                "admitted": self.engine.num_admitted,
                "finished": self.finished + (self.preparer.num_failed if self.preparer is not None else 0)}
