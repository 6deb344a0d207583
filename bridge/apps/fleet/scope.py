"""Which workers a query may be answered with: its model, tenant and
instance, against what each worker's registry entry says (docs/observe.md,
"Models and tenants").

The registry entry is keyed by worker (the follower refuses an entry whose
payload names another), so a worker's model and tenant are its own say.
Hashes alone cannot keep models apart: equal token ids hashed with the same
seed give equal hashes whatever the model, so the scope is applied to the
holders, not to the chain.

The rules, one place for every API (`/v1/prefix`, the NATS `prefix`
endpoint, the indexer API):

- the fleet's models are the distinct non-empty models of the entries of
  the workers the query may see (dead and stopped ones count only when the
  query includes them);
- a query that names no model on a fleet of more than one model is refused
  (`ModelMissing`, HTTP 400) with the models listed; on a fleet of one
  model, or of none (no bridge given `--model` or `--vllm-url`), it sees
  every worker;
- a query that names a model sees only that model's workers, unless the
  fleet knows no model at all (then the name cannot be checked, and every
  worker is seen);
- a tenant, where given, keeps the workers of that tenant (a worker with no
  entry, or an entry written before tenants, is tenant `default`);
- an instance, where given, keeps that worker alone."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

import msgspec

from bridge.apps.fleet.query import QueryError
from bridge.contract import DEFAULT_TENANT, WorkerEntry


class Scope(msgspec.Struct, frozen=True):
    """What a query is about besides its chain; None: not given."""

    model: str | None = None
    tenant: str | None = None
    instance: str | None = None


class ModelMissing(QueryError):
    """A query without a model on a fleet that serves several (HTTP 400)."""

    def __init__(self, models: list[str]) -> None:
        self.models = models
        super().__init__("the fleet serves more than one model: name one in 'model' (" + ", ".join(models) + ")")


def model_of(entry: WorkerEntry | None) -> str:
    return entry.model if entry is not None else ""


def tenant_of(entry: WorkerEntry | None) -> str:
    return entry.tenant if entry is not None else DEFAULT_TENANT


def fleet_models(entries: Mapping[str, WorkerEntry], hidden: Collection[str] = ()) -> list[str]:
    """The distinct models the entries name, but those of `hidden` workers."""
    return sorted({e.model for w, e in entries.items() if e.model and w not in hidden})


def out_of_scope(scope: Scope, workers: Iterable[str], entries: Mapping[str, WorkerEntry],
                 hidden: Collection[str] = ()) -> set[str]:
    """The `workers` the scope leaves out; `hidden`: workers the query does
    not see anyway (dead, stopped). Raises ModelMissing (module docstring)."""
    models = fleet_models(entries, hidden)
    if scope.model is None and len(models) > 1:
        raise ModelMissing(models)
    by_model = scope.model is not None and bool(models)
    out = set()
    for worker in workers:
        entry = entries.get(worker)
        if (by_model and model_of(entry) != scope.model
                or scope.tenant is not None and tenant_of(entry) != scope.tenant
                or scope.instance is not None and worker != scope.instance):
            out.add(worker)
    return out
