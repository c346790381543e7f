"""The kernel's interfaces that both sides read: the sock_diag netlink reader (the daemon's audit of a
namespace's connections; `gpukillctl serve`'s owner of a loopback client's socket)."""
