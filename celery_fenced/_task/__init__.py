"""The task side, in every process that defines fenced tasks (a web process that only sends
them included): the task class (:mod:`.task`), the owner's in-memory view of the lease its
body reports progress to and the worker's heartbeat serves (:mod:`.owner`), whether its body
may be interrupted now (:mod:`.interrupter`), what a send records for a takeover
(:mod:`.calls`), progress details (:mod:`.details`), the attempt a request carries while it
runs (:mod:`.running`) and the wiring that loads the worker side only in a worker
(:mod:`.wiring`)."""
