//! The membership part of [`DynamoLeaseStore`]: heartbeat rows, the membership read and the
//! membership view, beside the lease rows of the parent module.

use super::*;
use changefeed::lease::MembershipStore;

#[async_trait]
impl MembershipStore for DynamoLeaseStore {
    fn head_reads_per_second(&self) -> Option<f64> {
        Some(self.head_reads_per_second)
    }

    async fn heartbeat(
        &self,
        group: &GroupName,
        host: &HostName,
        incarnation: &str,
        written_at: Timestamp,
        expected: Option<Version>,
        role: HeartbeatRole,
        report: Option<&str>,
    ) -> Result<Heartbeat, LeaseError> {
        match role {
            HeartbeatRole::Member => {
                self.write_heartbeat(group, host, incarnation, written_at, expected, report)
                    .await
            }
            HeartbeatRole::Leader => {
                self.put_lead_heartbeat(group, host, incarnation, written_at, expected, report)
                    .await
            }
        }
    }

    async fn remove_heartbeat(
        &self,
        group: &GroupName,
        host: &HostName,
        incarnation: &str,
        expected: Version,
    ) -> Result<(), LeaseError> {
        let pk = self.heartbeat_key(group, host).await?;
        let result = self
            .client
            .delete_item()
            .table_name(&self.table)
            .key(PK, s(pk))
            .key(SK, s(format!("{HOST_PREFIX}{host}")))
            .condition_expression("attribute_not_exists(#pk) OR (#v = :v AND #inc = :inc)")
            .expression_attribute_names("#pk", PK)
            .expression_attribute_names("#v", A_VERSION)
            .expression_attribute_names("#inc", A_INCARNATION)
            .expression_attribute_values(":v", n(expected.0))
            .expression_attribute_values(":inc", s(incarnation.to_string()))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .return_consumed_capacity(ReturnConsumedCapacity::Total)
            .send()
            .await;
        match result {
            Ok(out) => {
                self.account(Kind::Write, out.consumed_capacity());
                Ok(())
            }
            Err(err) => match err.as_service_error() {
                Some(
                    aws_sdk_dynamodb::operation::delete_item::DeleteItemError::ConditionalCheckFailedException(e),
                ) => {
                    self.account_failed_write();
                    let current = match e.item() {
                        Some(item) if !item.is_empty() => {
                            Some(Box::new(parse_heartbeat(group, item)?))
                        }
                        _ => None,
                    };
                    Err(LeaseError::HeartbeatConflict {
                        group: group.to_string(),
                        host: host.to_string(),
                        current,
                    })
                }
                _ => Err(store_error(
                    "remove_heartbeat",
                    Some(format!("{group}/{host}")),
                    err,
                )),
            },
        }
    }

    async fn membership(&self, group: &GroupName) -> Result<Membership, LeaseError> {
        self.read_membership(group).await
    }

    async fn head(&self, group: &GroupName) -> Result<Option<GroupHead>, LeaseError> {
        self.read_head(group).await.map(Some)
    }

    async fn write_view(
        &self,
        group: &GroupName,
        view: &MembershipView,
        expected: u64,
    ) -> Result<MembershipView, LeaseError> {
        self.put_view(group, view, expected).await
    }
}
