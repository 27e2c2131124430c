"""Vertical federated learning's formats: run configuration, fusion parameters, the wire contract.

Sites hold different columns of the same patients. `config` holds the run configuration and the
split-training parameters, `wire` what may cross the network per message type, `saved` what a run
saves beside its weights (head.json, site.json), `table` reading a
party's ID column, `psi` the private ID alignment. Imports only `protocol`.
"""
