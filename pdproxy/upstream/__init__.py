"""pdproxy's client to the engines: ``engine_client``, the one seam the layers above see (pdproxy's
own responses and errors), over ``http1``, the pooled HTTP/1.1 client the request legs run on,
and aiohttp for probes and scrapes."""
