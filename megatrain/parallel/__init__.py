"""Several processes: how units are cut between the ranks and machines of a data-parallel world
(layout.py), what a process needs from the other ranks (distributed.py's `Collective`, and
`Single` for a world of one), the process groups that carry it out over torch.distributed
(processgroup.py), and starting the processes of one machine (launch.py)."""
