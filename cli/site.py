"""``fedsplit site``: what a hospital runs, and test partitions for simulated hospitals.

``fedsplit site run`` is the hospital agent: a Flower SuperNode whose ClientApp is fedsplit's
(``client/app.py``; Flower ships the code to it, the data never leaves), supervised by
`orchestration.site_agent`, after reading the hospital's data once as the ClientApp will
(`site_agent.read_site_data`: a missing, unlabelled or unreadable file is one line).
Training uses the GPU when torch sees one (run config ``device=auto``).

``fedsplit site prepare`` cuts a bundled dataset into one folder per simulated hospital, which is
how ``fedsplit up`` and the compose init service give every hospital only its own rows.

``fedsplit site policy FILE`` checks a hospital's policy file and prints the policy in force;
``fedsplit site egress`` prints what left the hospital (its egress log) and verifies the log
(docs/privacy.md, "Hospital policy" and "What left the hospital").
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from fedsplit.cli import site_egress, site_ledger, site_policy
from rich.console import Console

console = Console(stderr=True, highlight=False, soft_wrap=True)  # one line per message, in logs too
app = typer.Typer(help="Run a hospital agent, or prepare simulated hospitals' data.",
                  no_args_is_help=True)


@app.command("run")
def run(
    superlink: Annotated[str, typer.Option(help="The coordinator's SuperLink, HOST:PORT.")],
    data: Annotated[Path, typer.Option(help="This hospital's data: a CSV/Parquet/NPZ file, a "
                                            "folder holding exactly one, or what --recipe's "
                                            "reader reads (e.g. an .h5 file). Read once before "
                                            "the SuperNode starts: an unreadable file is refused "
                                            "(HospitalFailure, exit 13).")],
    root_cert: Annotated[Path | None, typer.Option(help="CA certificate that signed the "
                                                        "SuperLink's certificate (TLS).")] = None,
    key: Annotated[Path | None, typer.Option(help="This hospital's NIST-EC OpenSSH private key, "
                                                  "registered with the SuperLink (node auth).")] = None,
    insecure: Annotated[bool, typer.Option(help="Connect without TLS (tests on one machine only).")] = False,
    name: Annotated[str | None, typer.Option(help="Site name in reports (default: data folder).")] = None,
    port: Annotated[int, typer.Option(help="Port of this SuperNode's local Runtime API.")] = 9094,
    host: Annotated[str, typer.Option(help="Address of this SuperNode's local Runtime API.")] = "127.0.0.1",
    isolation: Annotated[str, typer.Option(help="subprocess: the agent runs the ClientApp itself; "
                                                "process: a separate flower-superexec does.")] = "subprocess",
    flwr_home: Annotated[Path | None, typer.Option(help="Flower state directory of this agent "
                                                        "(default ~/.fedsplit/<name>).")] = None,
    max_restarts: Annotated[int, typer.Option(min=0, help="Consecutive SuperNode restarts before "
                                                          "giving up.")] = 10,
    recipe: Annotated[str, typer.Option(help="This hospital's recipe (docs/recipes.md): "
                                             "package.module:Attribute or an installed "
                                             "fedsplit.recipes entry point; default: the run's.")] = "",
    recipe_params: Annotated[str, typer.Option(help="The recipe's parameters, a JSON object.")] = "{}",
    policy: Annotated[Path | None, typer.Option(help="This hospital's policy file (TOML): what it "
                                                     "runs and what may leave it "
                                                     "(docs/privacy.md); default: the defaults.")] = None,
    state_dir: Annotated[Path | None, typer.Option(help="Where this hospital keeps its privacy "
                                                        "ledger and egress log (default "
                                                        "FLWR_HOME/state).")] = None,
) -> None:
    """Run this hospital's agent: a Flower SuperNode with fedsplit's ClientApp."""
    from fedsplit.protocol.recipe import parse_params

    parse_params(recipe_params)  # not JSON: one line naming --recipe-params and the value
    if recipe_params.strip() not in ("", "{}") and not recipe:
        from fedsplit.protocol.errors import ConfigError

        raise ConfigError("--recipe-params are this hospital's own recipe's parameters: give the "
                          "recipe with --recipe (the run's recipe takes the run's parameters). "
                          f"Received: --recipe-params {recipe_params!r} without --recipe")
    from fedsplit.orchestration.site_agent import run_agent

    run_agent(superlink, data, root_cert=root_cert, key=key, insecure=insecure, name=name,
              port=port, host=host, isolation=isolation, flwr_home=flwr_home,
              max_restarts=max_restarts, on_start=console.print, recipe=recipe,
              recipe_params=recipe_params, policy=policy, state_dir=state_dir)


@app.command("prepare")
def prepare(
    out: Annotated[Path, typer.Option(help="Writes OUT/hospital-1/, OUT/hospital-2/, ...")],
    dataset: Annotated[str, typer.Option(help="Bundled dataset to split.")] = "breast-cancer",
    sites: Annotated[int, typer.Option(min=1, help="Simulated hospitals.")] = 3,
    partition: Annotated[str, typer.Option(help="iid, dirichlet:ALPHA or sizes:n1,n2,...")] = "iid",
    seed: Annotated[int, typer.Option(help="Seed of the split.")] = 0,
) -> None:
    """Split a bundled dataset into one data folder per simulated hospital."""
    from fedsplit.orchestration.experiment import prepare_partitions

    for path in prepare_partitions(out, dataset, sites, partition, seed).values():
        console.print(f"wrote {path.parent}")


app.command("policy")(site_policy.policy)
app.command("egress")(site_egress.egress)
app.command("ledger")(site_ledger.ledger)
