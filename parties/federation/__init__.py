"""Federation: each organisation starts its own party, with no common launcher, SSH or shared folder.

``vfl party job.toml --as NAME ...`` (:mod:`parties.federation.command`) starts one party on its own
host. The parties agree on a job file (:mod:`parties.federation.jobfile`); the first party in it, the
leader, opens an MPI port and serves a short authenticated hello (:mod:`parties.federation.hello`);
every other party proves it holds the key pinned for its name, is checked to run the same job, gets
the port name and joins over MPI's dynamic-process interface (:mod:`parties.federation.join`). From
there on it is the same runtime as ``vfl train`` (:func:`parties.training.train` on the joined
communicator), each party's files in its own ``--folder`` (:mod:`parties.federation.member`). A job file of
``kind = "hfl"`` (:mod:`parties.federation.hfl_job`) runs ``python -m parties.hfl``'s server and
client processes over the same join instead (:mod:`parties.federation.hfl_member`).
Walkthrough and threat model: ``docs/deployment.md``.
"""
