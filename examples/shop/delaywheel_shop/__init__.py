"""The order-timeout shop: an example application built on delaywheel, beside it and not in its wheel (`make demo`,
`python -m delaywheel_shop`)."""
