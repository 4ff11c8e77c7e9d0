"""Producer side of Sluiceway: the protocol, clients, the bulk pipeline. Never imports torch."""
