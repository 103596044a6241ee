"""ModelRouter: which of a server's models a request names. Each served model is a ServingContext (its engine,
its front-end settings, its metrics) under its served name; a request's `model` picks one, OpenAI's way:

- a name the server does not serve is a 404 `model_not_found` that lists the names it does;
- a request without a model (the routes where it is optional: /tokenize, /detokenize, /tokenizer_info) goes to
  the only model of a one-model server, and is a 400 naming the field on a server of several.
"""

from __future__ import annotations

from collections.abc import Sequence

from raylm.serving.errors import OpenAIError
from raylm.serving.generation import ServingContext


class ModelRouter:
    """The served models by name, in the order they were given (the order /v1/models lists them in)."""

    def __init__(self, contexts: Sequence[ServingContext]):
        if not contexts:
            raise ValueError("a server needs at least one model to serve")
        self.contexts = list(contexts)
        self._by_name: dict[str, ServingContext] = {}
        for context in self.contexts:
            if context.model_name in self._by_name:
                raise ValueError(f"served_model_name must differ between the models of a server; "
                                 f"{context.model_name!r} is given twice")
            self._by_name[context.model_name] = context

    @property
    def several(self) -> bool:
        return len(self.contexts) > 1

    def _names(self) -> str:
        return ", ".join(f"`{name}`" for name in self._by_name)

    def route(self, model: str | None) -> ServingContext:
        """The model a request names (None: it names none); OpenAIError 404 or 400 when there is none to take."""
        if model is None:
            if self.several:
                raise OpenAIError(400, f"model is required: this server serves several models ({self._names()})",
                                  "model", "missing_required_parameter")
            return self.contexts[0]
        context = self._by_name.get(model)
        if context is None:  # an adapter served as a model of its own (its base model's context answers)
            context = next((each for each in self.contexts if model in each.adapters), None)
        if context is None:
            raise OpenAIError(404, f"The model `{model}` does not exist; this server serves {self._names()}",
                              "model", "model_not_found")
        return context

    def check_engines(self) -> None:
        """Raises the 503 of the first model whose engine is not running (naming it, on a server of several)."""
        for context in self.contexts:
            try:
                context.check_engine()
            except OpenAIError as exc:
                if not self.several:
                    raise
                raise OpenAIError(exc.status, f"model `{context.model_name}`: {exc.message}", exc.param,
                                  exc.code) from exc
