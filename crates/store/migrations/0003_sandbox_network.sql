-- A sandbox's network settings as the client set them (JSON: allow_out, deny_out, dns_servers,
-- allow_public_traffic, mask_request_host), kept so a restarted server enforces them again.
ALTER TABLE sandboxes ADD COLUMN network TEXT NOT NULL DEFAULT '{}';
-- Required on user-port requests when public traffic is off.
ALTER TABLE sandboxes ADD COLUMN traffic_access_token TEXT;
