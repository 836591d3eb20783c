"""Render the Kubernetes recipe from one values file: what this prints is what you apply.

    python examples/k8s/render.py                            # the defaults of values.yaml
    python examples/k8s/render.py -f my-values.yaml | kubectl apply -f -
    python examples/k8s/render.py -f my-values.yaml --set run_name=exp2 --only actor

The manifests beside this file (run-token.yaml, storage.yaml, critic.yaml, actor-job.yaml for
one actor node or actor-pytorchjob.yaml for several, actor-network.yaml, and with rollout workers
rollout-workers.yaml and, for one actor node, rollout-store.yaml) hold ``${name}`` placeholders
for the keys of values.yaml, and for keys computed from them (``DERIVED``): ``actor_workers``
(actor_nodes - 1), ``critic_gpus`` (critic_tensor_parallel x critic_data_parallel, the server's
processes), ``rollout_overrides`` (what the actor and its workers are both given), and from
``tls_secret`` the critic's URL scheme, the host its probes dial and the ``--tls-*`` flags of its
probes and of the actor's wait. ``run_token`` left null is a new random token (the Secret both
roles read), made on each render: what one render prints is one run's set of manifests.
Rendering is text substitution, so YAML reads a value as it would read it typed in place: a
placeholder in quotes stays a string, a bare one takes the value's type (``replicas: ${n}`` is a
number), a mapping or list becomes a flow collection. Four rules beyond that:

- a list item that is only a placeholder (``- ${actor_overrides}``) takes the value's items, one
  per line (none for an empty list);
- an item of a flow list that is only a quoted placeholder (``[wait, "${flags}", --timeout, "9"]``)
  whose value is a list takes its items in its place (none for an empty list);
- a line ``key: ${name}`` whose value is null is left out, so the field stays unset;
- the lines between a comment line ``#if ${name}`` and its ``#end`` (blocks nest) are kept only
  when the value is set (not null, false or empty); the two marker lines are always left out, so
  a block that is not kept leaves no trace.

Your values file needs only the keys it changes; an unknown key, a value of the wrong type or a
placeholder without a value is an error that names it. Needs Python 3.10+ and PyYAML (installed
with the project).
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
DEFAULT_VALUES = HERE / "values.yaml"
PARTS = ("secret", "storage", "critic", "actor", "rollout")
ROLLOUT_PORT = 29650  # the port of the store the actor hosts for its rollout workers
PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_SPLICE = re.compile(r"^(\s*)- \$\{([A-Za-z_][A-Za-z0-9_]*)\}\s*$")
_NULLABLE_FIELD = re.compile(r"^\s*[A-Za-z0-9_.\-/]+: \$\{([A-Za-z_][A-Za-z0-9_]*)\}\s*$")
_FLOW_SPLICE = re.compile(r', "\$\{([A-Za-z_][A-Za-z0-9_]*)\}"(?=\s*[,\]])')
_IF = re.compile(r"^\s*#if \$\{([A-Za-z_][A-Za-z0-9_]*)\}\s*$")
_END = re.compile(r"^\s*#end\s*$")
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# Keys whose value is computed from others; a values file may not set them.
DERIVED = {
    "actor_workers": "actor_nodes - 1",
    "critic_gpus": "critic_tensor_parallel x critic_data_parallel",
    "rollout_overrides": "rollout_workers, the actor's store address, rollout_tensor_parallel, rollout_score_on_workers",
    "critic_scheme": "tls_secret: grpcs with it, grpc without",
    "critic_probe_host": "tls_secret: localhost (a name the certificate holds) with it, 127.0.0.1 without",
    "critic_tls_flags": "tls_secret and tls_client_auth",
}
# Keys whose null default stands for "the default of the role": an integer or null.
OPTIONAL_INTS = ("actor_generation_tensor_parallel",)
MIN_TOKEN_CHARS = 16
# Where every pod that speaks to the critic mounts tls_secret's files (the manifests name the same
# paths in the roles' overrides): tls.crt, tls.key and ca.crt, and with tls_client_auth the
# actor's client.crt and client.key.
TLS_DIR = "/var/run/secrets/aligner-tls"


class RenderError(ValueError):
    """A values file or template problem; the message names the key."""


def load_values(files: list[str | Path] = (), sets: list[str] = ()) -> dict[str, Any]:
    """values.yaml's defaults, updated by each file in ``files`` and each ``key=value`` in ``sets``
    (the value read as YAML); checked with :func:`check_values`."""
    defaults = yaml.safe_load(DEFAULT_VALUES.read_text())
    values = dict(defaults)
    errors: list[str] = []
    for f in files:
        data = yaml.safe_load(Path(f).read_text()) or {}
        if not isinstance(data, dict):
            raise RenderError(f"{f}: expected a mapping of values, got {type(data).__name__}")
        for k, v in data.items():
            if k not in defaults:
                errors.append(f"{f}: {_unknown(k, defaults)}")
            values[k] = v
    for s in sets:
        if "=" not in s:
            errors.append(f"--set {s!r}: expected key=value")
            continue
        k, v = s.split("=", 1)
        if k not in defaults:
            errors.append(f"--set {s}: {_unknown(k, defaults)}")
        values[k] = yaml.safe_load(v) if v else ""
    if errors:
        raise RenderError("\n".join(errors))
    check_values(values, defaults)
    return values


def _unknown(key: str, defaults: dict[str, Any]) -> str:
    if key in DERIVED:
        return f"{key!r} is computed ({DERIVED[key]}); set those instead"
    return f"unknown key {key!r}; expected one of {sorted(defaults)}"


def check_values(values: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Types as in values.yaml (a null default takes a string or null), plus the rules Kubernetes
    and the two roles impose; every problem is reported together."""
    e: list[str] = []
    for k, default in defaults.items():
        v = values.get(k)
        if k in OPTIONAL_INTS:
            ok = v is None or (isinstance(v, int) and not isinstance(v, bool))
            want = "an integer or null"
        elif default is None:
            ok = v is None or (isinstance(v, str) and v != "")
            want = "a non-empty string or null"
        elif isinstance(default, bool):
            ok, want = isinstance(v, bool), "true or false"
        elif isinstance(default, int):
            ok, want = isinstance(v, int) and not isinstance(v, bool), "an integer"
        elif isinstance(default, str):
            ok, want = isinstance(v, str) and v != "", "a non-empty string"
        elif isinstance(default, list):
            ok, want = isinstance(v, list), "a list"
        else:
            ok, want = isinstance(v, dict), "a mapping"
        if not ok:
            e.append(f"{k}={v!r}: expected {want}")
            continue
        for s in _strings(v):
            if any(c in s for c in '"\\\n') or "${" in s:
                e.append(f"{k}={v!r}: strings may not hold quotes, backslashes, newlines or '${{'")
    if e:
        raise RenderError("invalid values:\n  " + "\n  ".join(e))
    name = values["run_name"]
    if not _DNS_LABEL.match(name) or len(name) > 40:
        e.append(
            f"run_name={name!r}: expected a DNS label of at most 40 characters (lowercase letters, "
            "digits and '-', starting with a letter): it prefixes every object's name"
        )
    e += _layout_problems(values)
    token = values["run_token"]
    if token is not None and (len(token) < MIN_TOKEN_CHARS or not token.isprintable() or " " in token):
        e.append(
            f"run_token: expected at least {MIN_TOKEN_CHARS} printable characters without spaces "
            "(e.g. from `openssl rand -hex 32`), or null for a random one"
        )
    for k in ("save_interval", "wait_timeout_s", "rollout_workers"):
        if values[k] < 0:
            e.append(f"{k}={values[k]}: expected >= 0")
    for k in ("critic_overrides", "actor_overrides"):
        bad = [o for o in values[k] if not isinstance(o, str) or "=" not in o]
        if bad:
            e.append(f"{k}: {bad!r} are not Hydra overrides (key=value)")
    e += _tls_problems(values)
    if e:
        raise RenderError("invalid values:\n  " + "\n  ".join(e))


def _tls_problems(values: dict[str, Any]) -> list[str]:
    """tls_secret names a Secret (a DNS-1123 subdomain), mutual TLS needs it, and the roles'
    TLS settings come from these two keys alone: one set by hand in the overrides would leave the
    probes, the actor's URL and the wait plain."""
    e = []
    name = values["tls_secret"]
    if name is not None and (len(name) > 253 or not _DNS_SUBDOMAIN.match(name)):
        e.append(
            f"tls_secret={name!r}: expected the name of a Secret in namespace {values['namespace']!r}, a "
            "DNS-1123 subdomain (at most 253 lowercase letters, digits, '-' and '.', starting and "
            "ending with a letter or digit)"
        )
    if values["tls_client_auth"] is True and name is None:
        e.append(
            "tls_client_auth=true with tls_secret=null: mutual TLS needs a Secret holding tls.crt, "
            "tls.key, ca.crt and the actor's client.crt and client.key; set tls_secret to its name, "
            "or tls_client_auth: false"
        )
    for k, section in (("critic_overrides", "server.tls"), ("actor_overrides", "critic.tls")):
        by_hand = [
            o
            for o in values[k]
            if isinstance(o, str) and f"{o.split('=', 1)[0].lstrip('+~')}.".startswith(f"{section}.")
        ]
        if by_hand:
            e.append(
                f"{k}: {by_hand!r} set {section} by hand; set tls_secret (and tls_client_auth) instead, "
                "which also gives the probes, the actor's URL and its wait for the critic the same TLS"
            )
    return e


def _layout_problems(values: dict[str, Any]) -> list[str]:
    """The two roles' parallel layouts: the critic runs critic_tensor_parallel x
    critic_data_parallel processes in its pod; the actor's world (actor_nodes x
    actor_gpus_per_node) is TP x PP x DP, and it generates at a divisor of TP x PP."""
    critic = ("critic_tensor_parallel", "critic_data_parallel")
    actor = ("actor_nodes", "actor_gpus_per_node", "actor_tensor_parallel", "actor_pipeline_parallel")
    gen_tp = values["actor_generation_tensor_parallel"]
    e = [
        f"{k}={values[k]}: expected >= 1"
        for k in (*critic, *actor, "rollout_tensor_parallel")
        if values[k] < 1
    ]
    if gen_tp is not None and gen_tp < 1:
        e.append(f"actor_generation_tensor_parallel={gen_tp}: expected >= 1, or null for the training TP")
    if any(values[k] < 1 for k in actor) or (gen_tp is not None and gen_tp < 1):
        return e  # the checks below divide by these
    tp, pp = values["actor_tensor_parallel"], values["actor_pipeline_parallel"]
    nodes, per_node = values["actor_nodes"], values["actor_gpus_per_node"]
    if per_node % tp:
        e.append(
            f"actor_tensor_parallel={tp} does not divide actor_gpus_per_node={per_node}: "
            "a tensor-parallel group stays on one node"
        )
    if (nodes * per_node) % (tp * pp):
        e.append(
            f"actor_nodes={nodes} x actor_gpus_per_node={per_node} = {nodes * per_node} actor processes "
            f"are not divisible by actor_tensor_parallel={tp} x actor_pipeline_parallel={pp} = {tp * pp}"
        )
    if values["rollout_score_on_workers"] and values["rollout_workers"] == 0:
        e.append(
            "rollout_score_on_workers=true with rollout_workers=0: set rollout_workers to the number of workers"
        )
    if values["rollout_workers"] > 0 and gen_tp is not None:
        e.append(
            f"actor_generation_tensor_parallel={gen_tp} with rollout_workers={values['rollout_workers']}: "
            "the workers generate (rollout_tensor_parallel GPUs each); leave it null"
        )
    if gen_tp is not None and (tp * pp) % gen_tp:
        e.append(
            f"actor_generation_tensor_parallel={gen_tp} does not divide actor_tensor_parallel={tp} x "
            f"actor_pipeline_parallel={pp} = {tp * pp}: each generation group holds the whole model"
        )
    return e


def _strings(v: Any) -> list[str]:
    if isinstance(v, str):
        return [v]
    if isinstance(v, list):
        return [s for x in v for s in _strings(x)]
    if isinstance(v, dict):
        return [s for kv in v.items() for x in kv for s in _strings(x)]
    return []


def _scalar(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, dict)):
        return json.dumps(v)  # JSON is YAML flow syntax
    return str(v)


def render_text(template: str, values: dict[str, Any], name: str = "template") -> str:
    """``template`` with every placeholder replaced (see the module docstring for the rules)."""
    missing = sorted({m for m in PLACEHOLDER.findall(template) if m not in values})
    if missing:
        raise RenderError(f"{name}: no value for {', '.join('${' + m + '}' for m in missing)}")
    out: list[str] = []
    kept: list[bool] = []  # one per open #if block: whether its value is set
    for n, line in enumerate(template.splitlines(), 1):
        m = _IF.match(line)
        if m:
            kept.append(values[m.group(1)] not in (None, False, "", [], {}))
            continue
        if _END.match(line):
            if not kept:
                raise RenderError(f"{name}, line {n}: #end without its #if")
            kept.pop()
            continue
        if not all(kept):
            continue
        line = _FLOW_SPLICE.sub(lambda mm: _flow_items(values[mm.group(1)], mm.group(0)), line)
        m = _SPLICE.match(line)
        if m and isinstance(values[m.group(2)], list):
            out += [f"{m.group(1)}- {json.dumps(item)}" for item in values[m.group(2)]]
            continue
        m = _NULLABLE_FIELD.match(line)
        if m and values[m.group(1)] is None:
            continue
        out.append(PLACEHOLDER.sub(lambda mm: _scalar(values[mm.group(1)]), line))
    if kept:
        raise RenderError(f"{name}: {len(kept)} #if without its #end")
    return "\n".join(out) + "\n"


def _flow_items(value: Any, text: str) -> str:
    """A flow list's ``, "${name}"`` for a list value: its items, each after a comma."""
    return "".join(f", {json.dumps(item)}" for item in value) if isinstance(value, list) else text


def templates(values: dict[str, Any], only: str | None = None) -> list[Path]:
    """The template files for these values, in the order to apply them."""
    actor = "actor-job.yaml" if values["actor_nodes"] == 1 else "actor-pytorchjob.yaml"
    rollout = []
    if (
        values["rollout_workers"] > 0
    ):  # a one-node actor's store needs a Service; the operator names a Master's
        rollout = ["rollout-workers.yaml"] + (["rollout-store.yaml"] if values["actor_nodes"] == 1 else [])
    chosen = {
        "secret": ["run-token.yaml"],
        "storage": ["storage.yaml"],
        "critic": ["critic.yaml"],
        "actor": [actor, "actor-network.yaml"],
        "rollout": rollout,
    }
    parts = [only] if only else list(PARTS)
    return [HERE / f for p in parts for f in chosen[p]]


def rollout_overrides(values: dict[str, Any]) -> list[str]:
    """What the actor and its workers are both given beyond the actor's overrides: the number of
    workers, the store's address (the one-node actor's Service, or the Service the training
    operator makes for a PyTorchJob's Master), each worker's processes and whether the workers
    score their batches; none without workers."""
    n = values["rollout_workers"]
    if n == 0:
        return []
    host = (
        f"{values['run_name']}-rollout-store"
        if values["actor_nodes"] == 1
        else f"{values['run_name']}-actor-master-0"
    )
    out = [
        f"rollout.workers={n}",
        f"rollout.address={host}:{ROLLOUT_PORT}",
        f"rollout.tensor_parallel_size={values['rollout_tensor_parallel']}",
    ]
    return out + (["rollout.score_on_workers=true"] if values["rollout_score_on_workers"] else [])


def critic_tls_flags(values: dict[str, Any]) -> list[str]:
    """The TLS flags of the critic's probes and of the actor's wait for it (``aligner.critic.probe``
    and ``aligner.critic.wait`` take the same): the CA of the server's certificate and, with
    tls_client_auth, the client certificate the server requires; none without tls_secret."""
    if values["tls_secret"] is None:
        return []
    flags = ["--tls-ca-file", f"{TLS_DIR}/ca.crt"]
    if values["tls_client_auth"]:
        flags += ["--tls-cert-file", f"{TLS_DIR}/client.crt", "--tls-key-file", f"{TLS_DIR}/client.key"]
    return flags


def render(values: dict[str, Any], only: str | None = None) -> str:
    """The manifests to apply, as one multi-document YAML text (checked to parse)."""
    full = dict(values)
    full["actor_workers"] = values["actor_nodes"] - 1
    # The server runs one process per GPU, on one pod.
    full["critic_gpus"] = values["critic_tensor_parallel"] * values["critic_data_parallel"]
    full["rollout_overrides"] = rollout_overrides(values)
    # With TLS the probes dial localhost, a name the server's certificate must hold (127.0.0.1
    # would need an IP entry); the actor dials the Service's name.
    tls = values["tls_secret"] is not None
    full["critic_scheme"] = "grpcs" if tls else "grpc"
    full["critic_probe_host"] = "localhost" if tls else "127.0.0.1"
    full["critic_tls_flags"] = critic_tls_flags(values)
    # A fresh token per render unless one is given (URL-safe: no quoting needed in YAML).
    full["run_token"] = values["run_token"] or secrets.token_urlsafe(32)
    docs = []
    for path in templates(values, only):
        text = render_text(path.read_text(), full, path.name)
        try:
            list(yaml.safe_load_all(text))
        except yaml.YAMLError as e:  # a value that YAML reads differently than intended
            raise RenderError(f"{path.name} does not parse after rendering: {e}") from e
        docs.append(f"# Source: examples/k8s/{path.name}\n" + text)
    return "---\n".join(docs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python examples/k8s/render.py",
        description="Render the Kubernetes manifests of a PPO run from a values file.",
    )
    p.add_argument(
        "-f", "--values", action="append", default=[], help="values file (repeatable; later ones win)"
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="one value (repeatable)")
    p.add_argument(
        "--only",
        choices=PARTS,
        help="render one part: the run token's Secret, the shared volume, the critic, the actor or its rollout workers",
    )
    args = p.parse_args(argv)
    try:
        values = load_values(args.values, args.set)
        sys.stdout.write(render(values, args.only))
    except (RenderError, OSError) as e:
        print(f"render.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
