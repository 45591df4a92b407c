"""What every assignment's checks use: the spec (:mod:`.spec`), the harness (:mod:`.harness`),
judging (:mod:`.expect`), probes (:mod:`.probes`), the reference (:mod:`.reference`), speed
(:mod:`.speed`), ranks (:mod:`.ranks`, :mod:`.collectives`), training (:mod:`.training`) and
call timeouts (:mod:`.timeouts`). Modules that run in the sandbox (probes, ranks, collectives,
reference, training, spec) never import pytest."""
