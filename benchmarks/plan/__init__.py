"""``dosa plan``: where dosa wins, predicted from costs dosa measures itself and checked against the
testbed.

A round of each method (dosa sum and gtopk, a ring allreduce, a sparse allgather) is modelled from
per-entry, per-packet and per-byte costs (``costs``: the host side measured by the command, the
DPU's read from ``dosa bench dpu``'s JSON or a labelled fallback), the link and the cluster's shape
(``model``); ``validate`` runs ``dosa bench allreduce`` on the testbed and compares; ``report``
prints the table, writes the JSON and the plot; ``cli`` is the command. docs/performance.md
(*Where dosa wins*) has the model's equations, its assumptions and the validation.
"""
