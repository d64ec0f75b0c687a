# Sourced by the VM scripts (rxe-e2e, rxe-guest-bench): reading one series of an agent's
# /metrics without curl (the VM image has none), over bash's /dev/tcp.

# metric_value HOST:PORT SERIES: the value of SERIES (its name with labels, exactly as the
# exposition prints it) on that /metrics, 0 when the series is absent.
metric_value() {
	local v
	exec 3<>"/dev/tcp/${1%:*}/${1##*:}"
	printf 'GET /metrics HTTP/1.0\r\nHost: %s\r\n\r\n' "$1" >&3
	v=$(grep -v '^#' <&3 | grep -F "$2 " | awk '{ print $2 }' | head -1)
	exec 3<&-
	echo "${v:-0}"
}
