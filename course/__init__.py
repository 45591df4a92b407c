"""The workshop's small toolkit, imported by the lessons and the assignments.

- :mod:`course.devices`: which devices there are (GPUs, or labelled CPU stand-ins).
- :mod:`course.timing`: honest timing (synchronize, warm up, median of repeats).
- :mod:`course.data`: Fashion-MNIST through torchvision, or an announced synthetic stand-in.
- :mod:`course.models`: LeNet (functional, with a parameter list) and ResNet-18.
- :mod:`course.launch`: run a notebook-defined function on N processes.
- :mod:`course.planning`: memory per GPU and time per step of a parallel training run, on paper
  (mixture-of-experts models and expert parallelism in :mod:`course.planning_moe`).
- :mod:`course.collectives`, :mod:`course.compat`: watching collectives, and what differs
  between the torch releases the course supports.
- :mod:`course.flight`: per-rank traces of collective calls, for finding where a hung job's
  ranks stopped agreeing (lesson 17).
- :mod:`course.schedules`: pipeline schedules as per-rank action lists in torch's format,
  checked, simulated, counted and drawn (lesson 18).

Set ``COURSE_FULL=1`` in the environment for real-sized runs; by default every lesson runs
in a quick mode small enough for a laptop CPU.
"""
import os

#: Lessons and experiments use small sizes unless this is true (``COURSE_FULL=1``).
FULL_RUN = os.environ.get("COURSE_FULL", "0").lower() in {"1", "true", "yes"}
