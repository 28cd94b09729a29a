"""The order-timeout shop: an example application built on delaywheel (`make demo`)."""
