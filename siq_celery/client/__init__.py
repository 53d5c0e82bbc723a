"""The client of the store, one limit's and several limits' at once: an
:class:`~siq_celery.IntervalQueue` claims, asks the store, waits its turn, holds its body
until its slot and reports as it begins (queue.py), a
:class:`~siq_celery.CombinedQueue` passes every start through several queues at once
(combined.py), the lease keeper renews the leases of the bodies running in this process
(leases.py), and this process reads its clock against the store's from the answers
(reply_clock.py). Importing it installs nothing."""
