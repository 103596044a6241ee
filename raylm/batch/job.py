"""A batch job on Ray Data: read the rows (rows.py), skip those already answered (resume), answer the rest on a
pool of engine replicas (replica.py; Ray Data restarts a replica that dies and retries its blocks), write the
answers as JSONL files, and sum up."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from raylm.batch.config import BatchArgs
from raylm.batch.replica import BatchReplica
from raylm.batch.rows import KEY, AnswersDatasink, RowsDatasource, written_keys


@dataclass
class BatchSummary:
    rows: int
    errors: int
    input_tokens: int
    generated_tokens: int
    skipped: int
    seconds: float
    peak_rows_in_flight: int = 0  # the most rows one replica's engine answered at once
    answering_seconds: float = 0.0  # from the first block a replica took to the last it answered

    @property
    def generated_tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    @property
    def answering_tokens_per_s(self) -> float:
        """Generated tokens a second while the replicas answered: the job's rate without its start-up."""
        return self.generated_tokens / self.answering_seconds if self.answering_seconds else 0.0

    def __str__(self) -> str:
        return (f"{self.rows} rows answered ({self.errors} with errors, {self.skipped} already answered) in "
                f"{self.seconds:.1f} s: {self.input_tokens} prompt tokens, {self.generated_tokens} generated "
                f"({self.generated_tokens_per_s:.1f} tokens/s; {self.answering_tokens_per_s:.1f} over the "
                f"{self.answering_seconds:.1f} s of answering; at most {self.peak_rows_in_flight} rows at once in a "
                f"replica)")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "generated_tokens_per_s": self.generated_tokens_per_s,
                "answering_tokens_per_s": self.answering_tokens_per_s}


def replica_resources(args: BatchArgs, cluster_gpus: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the replica actor's Ray resources, its LLM's executor and device): a one-rank engine on a GPU runs in the
    actor (one GPU); a larger one places its ranks in a placement group of its own (Ray executor); without GPUs
    (or with device cpu) the engine runs in the actor on its CPUs. Device auto goes by the GPUs the cluster has
    when the job starts: on an autoscaling cluster whose GPU workers are not up yet, device cuda asks for them."""
    ranks = args.tensor_parallel_size * args.pipeline_parallel_size
    gpu = args.device == "cuda" or (args.device == "auto" and cluster_gpus > 0)
    if not gpu:
        return {"num_cpus": args.replica_cpus, "num_gpus": 0}, {"executor": "local", "device": "cpu"}
    if ranks == 1:
        return {"num_cpus": args.replica_cpus, "num_gpus": 1}, {"executor": "local", "device": "cuda"}
    return {"num_cpus": args.replica_cpus, "num_gpus": 0}, {"executor": "ray", "device": "cuda"}


def run_batch(args: BatchArgs | None = None, **fields: Any) -> BatchSummary:
    """Runs a batch job (BatchArgs, or its fields as keyword arguments) on the Ray cluster of RAY_ADDRESS (as
    `ray job submit` sets it; `auto` for one started with `ray start`) or this process's, starting a local one
    when there is none; returns its summary."""
    import ray
    import ray.data

    from raylm.actors.ray_executor import ensure_ray

    args = args if args is not None else BatchArgs(**fields)
    if "://" not in args.input and not Path(args.input).exists():
        raise ValueError(f"input {args.input!r} does not exist")
    begin = time.perf_counter()
    ensure_ray(num_cpus_hint=int(args.num_replicas * args.replica_cpus) + 2)
    done = written_keys(args.output)
    if done and not args.resume:
        raise ValueError(f"output {args.output!r} already holds {len(done)} answers: pass resume (--resume) to "
                         "skip their rows, or choose another output")
    actor_resources, engine = replica_resources(args, ray.cluster_resources().get("GPU", 0))
    rows = ray.data.read_datasource(RowsDatasource(args.input, rows_per_block=args.rows_per_block))
    if done:
        rows = rows.filter(lambda row: row[KEY] not in done)
    size = {"size": args.num_replicas} if args.max_replicas is None else {
        "min_size": args.num_replicas, "max_size": max(args.max_replicas, args.num_replicas)}
    answers = rows.map_batches(
        BatchReplica,
        fn_constructor_kwargs={"llm_options": {**args.llm_options(), **engine},
                               "served_model_name": args.served_model_name or args.model,
                               "chat_template": args.chat_template, "defaults": args.sampling},
        batch_size=args.rows_per_block,
        batch_format="numpy",
        # Threads (true multi-threading: without it Ray Data runs one call per actor at a time) hand every block
        # in flight to the one engine, which batches their rows together.
        compute=ray.data.ActorPoolStrategy(**size, max_tasks_in_flight_per_actor=args.blocks_in_flight,
                                           max_concurrent_calls_per_actor=args.blocks_in_flight,
                                           enable_true_multi_threading=True),
        max_restarts=-1, max_task_retries=-1,  # a replica that dies comes back; its blocks run again
        **actor_resources,
    )
    sink = AnswersDatasink(args.output)
    answers.write_datasink(sink)
    totals = getattr(sink, "totals", {"rows": 0, "errors": 0, "input_tokens": 0, "generated_tokens": 0})
    return BatchSummary(**totals, skipped=len(done), seconds=time.perf_counter() - begin)
