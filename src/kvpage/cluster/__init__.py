"""Scale-out: many engine replicas on Ray Serve behind one OpenAI-compatible ingress.

``kvpage serve --replicas N`` (or ``--ray-address ADDR``, or ``--deployment FILE``) runs
the serving stack of :mod:`kvpage.server` split in two: an **ingress** deployment that
owns the HTTP surface (the same FastAPI app, validation, authentication, admission,
error bodies and streaming as the single server) and **engine replica** deployments,
one replica group per engine configuration (``default``, optionally ``long_context``
and ``canary``). A custom Ray Serve ``RequestRouter`` (:mod:`kvpage.cluster.router`)
asks the routing policy of :mod:`kvpage.routing` which replica of a group gets each
request, using the KV events the replicas publish.

Modules (none is imported by ``import kvpage``; only :mod:`kvpage.cluster.config` and
:mod:`kvpage.cluster.cli` can be imported without Ray):

* :mod:`~kvpage.cluster.config` -- the deployment file (pydantic, dumpable);
* :mod:`~kvpage.cluster.replica` -- the engine replica deployment;
* :mod:`~kvpage.cluster.core` -- per-group router state (index, policy, loads);
* :mod:`~kvpage.cluster.router` -- the Ray Serve ``RequestRouter``;
* :mod:`~kvpage.cluster.remote` -- the ingress side of a request (retry, failures);
* :mod:`~kvpage.cluster.ingress` -- the ingress deployment and its metrics;
* :mod:`~kvpage.cluster.launch` -- starting Ray and deploying the application;
* :mod:`~kvpage.cluster.cli` -- the ``kvpage serve`` cluster flags.

See docs/serving.md, "Scaling out".
"""
