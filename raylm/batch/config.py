"""Arguments of a batch job (`raylm batch`, raylm.batch.run_batch): the engine's LlmArgs plus the job's own."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from raylm.config import LlmArgs


class BatchArgs(LlmArgs):
    """LlmArgs of every replica's engine, and where the rows come from and go to."""

    input: str = Field(min_length=1, description="JSONL or Parquet rows: a file, a directory, or a URI Ray Data "
                                                 "reads (s3://, gs://, ... where the filesystem is installed).")
    output: str = Field(min_length=1, description="Directory (or URI) the answers are written to, as JSONL files.")
    served_model_name: str | None = Field(default=None, min_length=1,
                                          description="The model name request bodies may give (default: model).")
    chat_template: str | None = Field(default=None, description="A Jinja chat template instead of the tokenizer's.")
    num_replicas: int = Field(default=1, ge=1, description="Engine replicas, each with tp x pp ranks (the fewest "
                                                           "with max_replicas).")
    max_replicas: int | None = Field(default=None, ge=1,
                                     description="Scale the replicas between num_replicas and this with the backlog.")
    blocks_in_flight: int = Field(default=4, ge=1, description="Blocks each replica's engine works on at once "
                                                               "(their rows are batched together continuously).")
    rows_per_block: int = Field(default=64, ge=1, description="Rows a replica takes at a time.")
    sampling: dict[str, Any] = Field(default_factory=dict,
                                     description="Request fields every table row starts from (max_tokens, "
                                                 "temperature, ...); a row's own columns override them.")
    resume: bool = Field(default=False, description="Skip the rows whose answers the output already holds; "
                                                    "without it an output holding answers is refused.")
    replica_cpus: float = Field(default=1.0, gt=0, description="CPUs each replica's actor reserves.")

    def llm_options(self) -> dict[str, Any]:
        """The arguments of each replica's LLM."""
        return self.model_dump(exclude=set(BatchArgs.model_fields) - set(LlmArgs.model_fields), exclude_unset=True)
