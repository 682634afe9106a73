"""Who goes first when the fleet is full (flow control), as policy without I/O.

``ticket`` says who a request is (its tenant, priority, deadline and cost in tokens);
``fair_queue`` orders the requests that wait: priority band, then weighted fair shares
between tenants counted in tokens, then earliest deadline, then arrival; ``limits`` keeps
each tenant within its requests and tokens per minute and its concurrency. The request
path's ``proxying.admission`` holds the waiting futures and applies these.
"""
