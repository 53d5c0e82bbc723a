"""The client of the store: an :class:`~siq_celery.IntervalQueue` (queue.py) claims a
place in line and asks the store for its start; what it does to its queue's shared state
as a whole (create, declare, override, pause, back off, reset) is control.py's; the wait
for a start, asking and sleeping until it is authorized, is waiting.py's; the body held
until its slot and its report as it begins, body.py's. A
:class:`~siq_celery.CombinedQueue` passes every start through several queues at once
(combined.py); the lease keeper renews the leases of the bodies running in this process
(leases.py); this process reads its clock against the store's from the answers
(reply_clock.py). Importing it installs nothing."""
