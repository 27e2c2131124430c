"""The hospital's policy, enforced where the hospital's own code runs: a Flower ClientApp mod.

`policy_mod` wraps every handler of a fedsplit ClientApp (``ClientApp(mods=[policy_mod(KIND)])``:
``horizontal`` for ``client/app.py``, ``vertical`` for ``client/vertical/app.py``, ``survival``
for ``client/survival/app.py``). For each message, before its handler runs, it reads the
hospital's policy (`protocol.site_policy.SitePolicy`, node config ``policy``) and refuses what
the policy does not allow (`check_request`), in this order:

- the run kind: the app's own, except the horizontal app's ``query.survival`` (the survival
  summary after a survival run: Kaplan-Meier counts, Breslow sums, the exact Cox fit), which
  is a ``survival`` run's, as ``fedsplit km`` and ``fedsplit cox`` (the survival app) are;
- the task: the run config's (``task``, unless ``auto``; the survival app's and
  ``query.survival``'s is ``survival``), and again the one the instruction states (the agreed
  schema a stats, train, evaluate or survival instruction carries, query.init's ``task``);
- the recipe, BEFORE any recipe module is imported (a reference is an import path: importing
  it runs its code): the hospital's own (node config ``recipe``; in Flower's simulation engine,
  where one operator runs every simulated hospital, also the run config's) is always allowed;
  the built-in models (no recipe, ``mlp``, ``cnn``, the survival task's Cox recipe) need
  ``builtin`` in ``recipes``; any other reference must be listed there;
- plain training: with ``allow_plain_training = false`` a train message must come with
  patient-level DP (run config ``dp``, level ``patient``); vertical training has no DP, so its
  ``train.step`` is refused.

After the handler, every item of its reply is classified into the policy's send kinds
(`client.policy.contents`); a reply carrying a kind ``send`` does not list, or stating a task the
policy does not take (a stats or setup reply's schema), is replaced by an error reply. Every
refusal is Flower's error reply whose reason is one `HospitalFailure` line (stage "its policy"),
as the coordinator records any hospital's failure. An error reply of the handler itself passes
as it is.

Every reply is recorded in the hospital's egress log (`client.policy.egress`, in
`client.policy.paths.state_dir`): sent, refused or failed. A reply whose record cannot be
written is not sent (an error reply says why): nothing leaves unrecorded.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedsplit.client.failures import describe
from fedsplit.client.node_config import NodeConfig
from fedsplit.client.policy import egress
from fedsplit.client.policy.contents import (
    UNKNOWN,
    Contents,
    Instruction,
    describe_items,
    read_instruction,
    reply_contents,
)
from fedsplit.client.policy.paths import hospital_policy, state_dir
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol import survival as sv
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.egress_log import UNGOVERNED_KINDS
from fedsplit.protocol.errors import ConfigError, HospitalFailure, one_line
from fedsplit.protocol.privacy import DPSpec
from fedsplit.protocol.recipe import BUILTIN_RECIPES
from fedsplit.protocol.site_policy import (
    BUILTIN,
    RUN_KINDS,
    SURVIVAL_RUN,
    PolicyRefusal,
    SitePolicy,
)
from fedsplit.protocol.tasks import recipe_kind

log = logging.getLogger(__name__)

STAGE = "its policy"

Mod = Callable[[Any, Any, Callable[[Any, Any], Any]], Any]


@dataclass(frozen=True)
class Request:
    """What a message asks of the hospital, read before its handler runs (nothing imported)."""

    app: str
    run_kind: str
    message: str
    site: str
    tasks: tuple[tuple[str, str], ...] = ()  # (task, where it was stated)
    recipe: str | None = None  # None: the app runs no recipe; "": the built-in model
    own_recipe: bool = False
    training: bool = False
    patient_dp: bool = False
    dp: str = ""


def policy_mod(run_kind: str) -> Mod:
    """The mod that enforces the hospital's policy around every handler of the ClientApp of
    ``run_kind`` (one of `protocol.site_policy.RUN_KINDS`) and logs every reply it sends."""
    if run_kind not in RUN_KINDS:
        raise ConfigError(f"policy_mod takes the ClientApp's run kind, one of {RUN_KINDS}. "
                          f"Received: {run_kind!r}")

    def mod(msg: Any, context: Any, call_next: Callable[[Any, Any], Any]) -> Any:
        return _enforce(run_kind, msg, context, call_next)

    mod.__name__ = mod.__qualname__ = f"policy_mod_{run_kind}"
    return mod


def message_run_kind(app: str, message_type: str) -> str:
    """The run kind a message belongs to: the app's, except the horizontal app's
    ``query.survival`` (a survival run's summary)."""
    return "survival" if app == "horizontal" and message_type == sv.QUERY else app


# --- before the handler ---------------------------------------------------------------------
def _run_config(context: Any) -> RunConfig | None:
    try:
        return RunConfig.from_flower(context.run_config)
    except Exception:  # the handler names a bad run config itself
        return None


def site_of(app: str, context: Any, node: NodeConfig) -> str:
    """This hospital's name as the app's own handlers name it: node config ``site-name``, else
    the run's name for its partition (run config ``site-names``), else ``site-<partition-id>``,
    else ``node-<id>`` (the vertical app: ``site-<id>``)."""
    if node.partition_id is None and not node.site_name:
        return f"{'site' if app == 'vertical' else 'node'}-{context.node_id}"
    names: list[str] = []
    try:
        if app == "horizontal" and (cfg := _run_config(context)) is not None:
            names = cfg.names
        elif app == SURVIVAL_RUN:
            names = sv.SurvivalRun.from_flower(context.run_config).names
    except Exception:  # a misconfigured name is the handler's to report
        names = []
    return node.name(context.node_id, names)


def _instruction_task(msg: Any) -> str | None:
    """The task an instruction states: its agreed schema's, or query.init's ``task``."""
    if not msg.has_content():
        return None
    for record in (wire.CONFIG, sv.RECORD):
        config = msg.content.config_records.get(record)
        if config is None:
            continue
        if wire.SCHEMA_KEY in config:
            try:
                task = json.loads(str(config[wire.SCHEMA_KEY])).get("task")
            except (ValueError, AttributeError):
                task = None
            if task:
                return str(task)
        if record == wire.CONFIG and "task" in config:
            return str(config["task"])
    return None


def read_request(app: str, msg: Any, context: Any, node: NodeConfig) -> Request:
    """What ``msg`` asks of this hospital (never raises: what cannot be read is the
    handler's to report)."""
    message = str(msg.metadata.message_type)
    run_kind = message_run_kind(app, message)
    site = site_of(app, context, node)
    raw = context.run_config
    tasks: list[tuple[str, str]] = []
    if SURVIVAL_RUN in (app, run_kind):
        tasks.append(("survival", "the survival analyses"))
    if app == "horizontal":
        cfg = _run_config(context)
        task = cfg.task if cfg is not None else str(raw.get("task", "auto") or "auto")
        if task != "auto":
            tasks.append((task, "run config task"))
        if (stated := _instruction_task(msg)) is not None:
            tasks.append((stated, f"the {message} instruction"))
        own = node.recipe
        recipe = own or (cfg.recipe if cfg is not None else str(raw.get("recipe", "") or ""))
        dp = cfg.dp if cfg is not None else str(raw.get("dp", "") or "")
        try:
            spec = DPSpec.parse(dp)
        except ConfigError:
            spec = None
        return Request(app, run_kind, message, site, tuple(tasks), recipe,
                       own_recipe=bool(own) or (bool(recipe) and node.simulated),
                       training=message.split(".")[0] == "train",
                       patient_dp=spec is not None and spec.level == "patient", dp=dp)
    if app == "vertical":
        task = str(raw.get("task", "auto") or "auto")
        if task != "auto":
            tasks.append((task, "run config task"))
    return Request(app, run_kind, message, site, tuple(tasks),
                   training=message.split(".")[0] == "train")


def _builtin(ref: str) -> str | None:
    """The built-in model a recipe reference stands for, else None."""
    if not ref:
        return "model (MLP or CNN)"
    if ref in BUILTIN_RECIPES:
        return ref.upper()
    if (kind := recipe_kind(ref)) is not None:  # a task kind's own (survival: the Cox model)
        return f"{kind.recipe.rpartition(':')[2]} model"
    return None


def check_request(policy: SitePolicy, request: Request) -> None:
    """Raise `PolicyRefusal` (one line: what, the fix, what was received) for the first thing
    ``request`` asks that ``policy`` does not allow."""
    if request.run_kind not in policy.run_kinds:
        raise PolicyRefusal(
            f"this hospital takes no {request.run_kind} runs (its policy's run_kinds: "
            f"{', '.join(policy.run_kinds) or 'none'}); to take them, add {request.run_kind!r} "
            f"to run_kinds in its policy file. Received: a {request.run_kind} run's "
            f"{request.message}")
    for task, where in request.tasks:
        if task not in policy.tasks:
            raise PolicyRefusal(
                f"this hospital does not take the task {task} (its policy's tasks: "
                f"{', '.join(policy.tasks) or 'none'}); to take it, add {task!r} to tasks in "
                f"its policy file. Received: task {task!r} ({where})")
    if request.recipe is not None and not request.own_recipe:
        builtin = _builtin(request.recipe)
        if builtin is not None and BUILTIN not in policy.recipes:
            raise PolicyRefusal(
                f"this hospital runs no built-in model (its policy's recipes: "
                f"{', '.join(policy.recipes) or 'none'}); add {BUILTIN!r} to recipes in its "
                f"policy file, or give its agent its own --recipe. Received: the built-in "
                f"{builtin}")
        if builtin is None and not policy.allows_recipe(request.recipe):
            raise PolicyRefusal(
                f"this hospital does not run the recipe {request.recipe} that the run names "
                f"(its policy's recipes: {', '.join(policy.recipes) or 'none'}; the recipe was "
                f"not imported); add it to recipes in its policy file, or give its agent "
                f"--recipe {request.recipe} as its own. Received: recipe {request.recipe!r} "
                f"(run config)")
    if request.training and not policy.allow_plain_training and not request.patient_dp:
        if request.app == "vertical":
            raise PolicyRefusal(
                "this hospital trains only with patient-level DP (its policy: "
                "allow_plain_training = false), and vertical training has none; set "
                "allow_plain_training = true in its policy file to take it. Received: "
                f"vertical {request.message}")
        raise PolicyRefusal(
            "this hospital trains only with patient-level DP (its policy: allow_plain_training "
            "= false); run with --dp epsilon=E,delta=D (level patient), or set "
            f"allow_plain_training = true in its policy file. Received: dp={request.dp!r}")


# --- after the handler ----------------------------------------------------------------------
def check_reply(policy: SitePolicy, contents: Contents) -> None:
    """Raise `PolicyRefusal` when a reply carries an item of a kind ``policy.send`` does not
    list (naming the kind and the items), or states a task the policy does not take."""
    allowed = set(policy.send) | set(UNGOVERNED_KINDS)
    blocked = [i for i in contents.items if not set(i.kinds) <= allowed]
    if blocked:
        kinds = sorted({k for i in blocked for k in i.kinds if k not in allowed})
        if UNKNOWN in kinds:
            fix = ("nothing fedsplit cannot classify leaves; update the hospital's fedsplit "
                   "(client/policy/contents.py)")
        else:
            fix = (f"nothing was sent; to let it leave, add {', '.join(repr(k) for k in kinds)} "
                   f"to send in the policy file")
        raise PolicyRefusal(
            f"the reply would send {' and '.join(kinds)}, which its policy's send does not list "
            f"({', '.join(policy.send) or 'none'}); {fix}. Received: {len(blocked)} item(s): "
            f"{describe_items(blocked)}")
    if contents.task is not None and contents.task not in policy.tasks:
        raise PolicyRefusal(
            f"this hospital does not take the task {contents.task} (its policy's tasks: "
            f"{', '.join(policy.tasks) or 'none'}); nothing was sent; to take it, add "
            f"{contents.task!r} to tasks in its policy file. Received: task {contents.task!r} "
            f"(its data)")


# --- the mod --------------------------------------------------------------------------------
def _error_reply(msg: Any, line: str) -> Any:
    from flwr.app import Error, Message
    from flwr.common.constant import ErrorCode

    return Message(Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason=line), reply_to=msg)


def _plain(value: Any) -> Any:
    """A JSON value the canonical form accepts (non-finite numbers as text)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _fields(request: Request, instruction: Instruction, msg: Any, node: NodeConfig, outcome: str,
            reason: str | None, contents: Contents | None = None) -> dict[str, Any]:
    """An egress record's fields (`protocol.egress_log.FIELDS` but id, at and prev_hash)."""
    sent = contents if contents is not None else Contents()
    return _plain({
        "run": int(msg.metadata.run_id), "site": request.site,
        "coordinator": node.coordinator,
        "run_kind": request.run_kind, "message": instruction.message,
        "group": str(msg.metadata.group_id or ""), "round": instruction.server_round,
        "outcome": outcome, "reason": reason, "tensors": [i.to_json() for i in sent.items],
        "counts": sent.counts, "metrics": sent.metrics, "labels": sent.labels,
        "categories": sent.categories, "withheld": sent.withheld, "epsilon": sent.epsilon,
        "bytes": sent.nbytes})


def _state(app: str, context: Any, node: NodeConfig, site: str) -> Any:
    cfg = _run_config(context) if app == "horizontal" else None
    if cfg is None:
        cfg = RunConfig.model_validate(
            {"data-dir": str(context.run_config.get("data-dir", "") or "")})
    return state_dir(node, cfg, site)


def _record(app: str, context: Any, node: NodeConfig, site: str, fields: dict[str, Any]) -> None:
    egress.append(_state(app, context, node, site), fields)


def _enforce(app: str, msg: Any, context: Any, call_next: Callable[[Any, Any], Any]) -> Any:
    try:  # the node config, read once per message (`client.node_config`)
        node, unread = NodeConfig.from_flower(context.node_config), None
    except ConfigError as e:  # refused below, once the request is named
        node, unread = NodeConfig(), e
    request = read_request(app, msg, context, node)
    instruction = read_instruction(msg)

    def refuse(error: Exception) -> Any:
        line = str(HospitalFailure(request.site, STAGE, describe(error)
                                   if not isinstance(error, PolicyRefusal) else str(error)))
        try:
            _record(app, context, node, request.site,
                    _fields(request, instruction, msg, node, "refused", line))
        except Exception as e:  # the refusal goes back all the same
            log.warning("hospital %s: the egress log did not take a refusal: %s", request.site, e)
        return _error_reply(msg, line)

    try:
        if unread is not None:
            raise unread
        policy = hospital_policy(node)
        check_request(policy, request)
    except ConfigError as e:  # a refusal, or a policy file that cannot be read
        return refuse(e)
    try:
        reply = call_next(msg, context)
    except Exception as e:  # the handler's own failure: Flower replies with it
        try:
            _record(app, context, node, request.site, _fields(request, instruction, msg, node,
                                                        "failed", describe(e)))
        except Exception as logged:
            log.warning("hospital %s: the egress log did not take a failure: %s", request.site,
                        logged)
        raise
    if reply.has_error():  # the handler's own error reply passes, recorded
        try:
            _record(app, context, node, request.site, _fields(
                request, instruction, msg, node, "failed", one_line(reply.error.reason)))
        except Exception as e:
            log.warning("hospital %s: the egress log did not take a failure: %s", request.site, e)
        return reply
    contents = reply_contents(app, instruction, reply.content)
    try:
        check_reply(policy, contents)
    except PolicyRefusal as e:
        return refuse(e)
    try:
        _record(app, context, node, request.site,
                _fields(request, instruction, msg, node, "sent", None, contents))
    except Exception as e:  # nothing leaves unrecorded
        line = str(HospitalFailure(
            request.site, STAGE, "the reply was not sent: its egress log cannot be written",
            f"Make the hospital's state folder (node config state-dir) writable and check the "
            f"log with `fedsplit site egress --verify`. Received: {describe(e)}"))
        return _error_reply(msg, line)
    return reply
