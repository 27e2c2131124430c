"""The run record: every JSON document a fedsplit run writes, one model per document, split by
run kind. Each document is written and read only through its model (docs/run-record.md):

- `protocol.record.common`: what every document shares (`JsonFile`, the metric type, the file
  names);
- `protocol.record.horizontal`: ``history.json`` of a horizontal Flower run (`RunRecord`);
- `protocol.record.summary`: ``summary.json`` of ``fedsplit simulate`` (`RunSummary`);
- `protocol.record.privacy`: the privacy section and ``privacy.json`` (`AuditResult`);
- `protocol.record.vertical`: a vertical run's ``history.json``, ``summary.json`` and
  ``fills.json``;
- `protocol.record.survival`: ``fedsplit km`` / ``fedsplit cox``'s status file, ``km.json``
  (`KMDocument`) and ``cox.json`` (`CoxDocument`);
- `protocol.record.kinds`: which kind of run wrote a ``history.json``, read as its model
  (`load_run_record`).

The aggregation report, a part of ``history.json`` that every aggregation rule builds, lives in
`protocol.aggregation_report` so the rules import it without the rest of the record. This
package's ``__init__`` imports nothing, so a reader loads only the modules it names.
"""
